"""Kernel providers. The torch references register with their ops; vendor providers live here, one file each.

Importing this package never imports a vendor package: each provider imports its package
inside ``build``, so a missing or broken ``torch_npu`` / ``liger_kernel`` / ``fla`` only
matters when a plan actually chooses that provider.
"""

import engine.ops  # noqa: F401  (the torch reference of every op)
from engine.kernels import compiled, fla, liger, liger_flce, npu  # noqa: F401  (import registers)
