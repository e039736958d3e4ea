"""An emulator of the three ``torch_npu`` ops the ``npu`` provider calls, for CPU tests.

Written from the vendor's documented contracts (``torch_npu/_op_plugin_docs.py``), not from
our provider, so that a wrong argument mapping in the provider shows up as wrong numbers:

* ``npu_rms_norm(x, gamma, epsilon=1e-6) -> (y, rstd)`` with
  ``rstd = rsqrt(mean(x^2, -1) + eps)`` and ``y = x * rstd * gamma``.
* ``npu_swiglu(x, dim=-1) -> silu(a) * b`` with ``a, b = x.chunk(2, dim)``.
* ``npu_rotary_mul(x, r1, r2, rotary_mode="half") -> x * r1 + cat(-x2, x1) * r2``, 4-D inputs.

Assumption (the documentation gives formulas, not rounding): like every fused vendor kernel,
each op computes in fp32 and rounds once to the input dtype; ``rstd`` is fp32 with the
reduced dimension kept. The emulator also enforces the documented input constraints it
relies on (``gamma`` in ``x``'s dtype, 4-D rotary inputs with an even last dimension), so a
provider that violates them fails here as it would on the device.

Install with ``monkeypatch.setitem(sys.modules, "torch_npu", make_torch_npu())``.
"""

from __future__ import annotations

import importlib.machinery
import types

import torch
import torch.nn.functional as F

__all__ = ["make_torch_npu"]


def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    if gamma.dtype != x.dtype:
        raise TypeError(f"npu_rms_norm: gamma dtype {gamma.dtype} must equal x dtype {x.dtype}")
    if gamma.shape != x.shape[x.dim() - gamma.dim():]:
        raise ValueError(f"npu_rms_norm: gamma shape {tuple(gamma.shape)} must be x's trailing shape")
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
    return (xf * rstd * gamma.float()).to(x.dtype), rstd


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    a, b = x.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(x.dtype)


def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, rotary_mode: str = "half") -> torch.Tensor:
    if rotary_mode != "half":
        raise NotImplementedError("the emulator implements rotary_mode='half' only")
    if x.dim() != 4 or r1.dim() != 4 or r2.dim() != 4:
        raise ValueError("npu_rotary_mul: x, r1 and r2 must be 4-D")
    if x.shape[-1] % 2:
        raise ValueError("npu_rotary_mul: the last dimension must be even")
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * r1.float() + torch.cat((-x2, x1), dim=-1) * r2.float()).to(x.dtype)


def make_torch_npu() -> types.ModuleType:
    """A fresh ``torch_npu`` module object holding the emulated ops (and a spec, so find_spec works)."""
    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
    module.npu_rms_norm = npu_rms_norm  # type: ignore[attr-defined]
    module.npu_swiglu = npu_swiglu  # type: ignore[attr-defined]
    module.npu_rotary_mul = npu_rotary_mul  # type: ignore[attr-defined]
    module.calls = []  # type: ignore[attr-defined]
    for name in ("npu_rms_norm", "npu_swiglu", "npu_rotary_mul"):
        setattr(module, name, _counted(module, getattr(module, name)))
    return module


def _counted(module: types.ModuleType, fn):  # type: ignore[no-untyped-def]
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        module.calls.append(fn.__name__)  # type: ignore[attr-defined]
        return fn(*args, **kwargs)

    wrapper.__name__ = fn.__name__
    return wrapper
