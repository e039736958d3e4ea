"""Kernel providers. The torch references register with their ops; vendor providers live here, one file each."""

import engine.ops  # noqa: F401  (the torch reference of every op)
