"""Kernel providers: the torch reference of every op, and one file per vendor provider.

Importing this package never imports a vendor package: each provider imports its package
inside ``build``, so a missing or broken ``torch_npu`` / ``liger_kernel`` / ``fla`` only
matters when a plan actually chooses that provider.
"""

from engine.kernels import torch_reference  # noqa: F401  (first: registers `torch` for every op)

# isort: split
from engine.kernels import compiled, fla, liger, liger_flce, moe, npu  # noqa: F401  (import registers)
