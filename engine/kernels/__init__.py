"""Kernel providers. The torch references register with their ops; other providers live here, one file each."""

import engine.ops  # noqa: F401  (the torch reference of every op)
from engine.kernels import compiled, liger_flce  # noqa: F401  (import registers; vendor imports stay lazy)
