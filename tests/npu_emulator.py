"""The emulated ``torch_npu`` the tests install: :mod:`engine.kernels.npu_emulation` (audits run it too)."""

from engine.kernels.npu_emulation import make_torch_npu

__all__ = ["make_torch_npu"]
