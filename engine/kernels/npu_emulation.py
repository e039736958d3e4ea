"""An emulator of the ``torch_npu`` ops the ``npu`` provider (and the stacks an audit runs) call, on the CPU.

Why in the package and not only in the tests: ``patch-engine audit --with twinkle`` (or
``llamafactory-v1``) runs those stacks' NPU kernels on a machine without an NPU, the way
``verify --interpret`` runs Triton kernels, and the report says so. An op it does not emulate
raises ``AttributeError`` naming it (the audit reports the kernel as unchecked, never as passed).

Written from the vendor's documented contracts (``torch_npu/_op_plugin_docs.py``), not from
our provider, so that a wrong argument mapping in the provider shows up as wrong numbers:

* ``npu_rms_norm(x, gamma, epsilon=1e-6) -> (y, rstd)`` with
  ``rstd = rsqrt(mean(x^2, -1) + eps)`` and ``y = x * rstd * gamma``.
* ``npu_swiglu(x, dim=-1) -> silu(a) * b`` with ``a, b = x.chunk(2, dim)``.
* ``npu_rotary_mul(x, r1, r2, rotary_mode="half") -> x * r1 + cat(-x2, x1) * r2``, 4-D inputs;
  ``rotary_mode="interleave"`` rotates adjacent pairs: ``x * r1 + stack(-x_odd, x_even) * r2``.
* ``npu_gelu(x, approximate="none") -> gelu(x)`` (``"none"``: erf, ``"tanh"``: the tanh form).
* ``npu_geglu(x, dim=-1, approximate=1, activate_left=False) -> (a * gelu(b), gelu(b))`` with
  ``a, b = x.chunk(2, dim)`` (approximate 1: tanh, 0: erf).

MoE (``aclnnMoeTokenPermute`` / ``mindspore.ops.moe_token_unpermute`` / ``npu_grouped_matmul`` docs):

* ``npu_moe_token_permute(tokens, indices, num_out_tokens=None, padded_mode=False)
  -> (permuted_tokens, sorted_indices)``: ``sorted_indices = argsort(argsort(indices.flatten()))``
  (int32; a stable sort), ``permuted_tokens[sorted_indices[i]] = tokens[i // topk]``.
* ``npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
  restore_shape=None) -> out[t] = sum_k permuted_tokens[sorted_indices[t*topk + k]] * probs[t, k]``.
* ``npu_grouped_matmul(x, weight, *, bias=None, group_list=None, split_item=0, group_type=-1,
  group_list_type=0, ...) -> [y]``: with one x [M, K], one weight [E, K, N], ``split_item`` 2 or 3
  (single-tensor output) and ``group_type=0`` (groups along M): ``y[rows of group e] = x[rows] @ w[e]``;
  ``group_list`` is int64, cumulative ends (``group_list_type=0``) or counts (``1``).

All three are differentiable on the device (torch_npu registers their backward); the
emulator is written in differentiable torch ops.

Assumption (the documentation gives formulas, not rounding): like every fused vendor kernel,
each op computes in fp32 and rounds once to the input dtype; ``rstd`` is fp32 with the
reduced dimension kept. The emulator also enforces the documented input constraints it
relies on (``gamma`` in ``x``'s dtype, 4-D rotary inputs with an even last dimension), so a
provider that violates them fails here as it would on the device.

Install with ``monkeypatch.setitem(sys.modules, "torch_npu", make_torch_npu())`` (the tests), or
:func:`emulated_torch_npu` (a context manager, for an audit).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import sys
import types
from collections.abc import Iterator

import torch
import torch.nn.functional as F

__all__ = ["EMULATED", "emulated_torch_npu", "make_torch_npu"]

#: The ops emulated, by their documented names.
EMULATED = ("npu_rms_norm", "npu_swiglu", "npu_rotary_mul", "npu_moe_token_permute", "npu_moe_token_unpermute",
            "npu_grouped_matmul", "npu_geglu", "npu_gelu")


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
    if rotary_mode not in ("half", "interleave"):
        raise ValueError(f"npu_rotary_mul: rotary_mode must be 'half' or 'interleave', got {rotary_mode!r}")
    if x.dim() != 4 or r1.dim() != 4 or r2.dim() != 4:
        raise ValueError("npu_rotary_mul: x, r1 and r2 must be 4-D")
    if x.shape[-1] % 2:
        raise ValueError("npu_rotary_mul: the last dimension must be even")
    xf = x.float()
    if rotary_mode == "half":
        x1, x2 = xf.chunk(2, dim=-1)
        turned = torch.cat((-x2, x1), dim=-1)
    else:
        turned = torch.stack((-xf[..., 1::2], xf[..., 0::2]), dim=-1).flatten(-2)
    return (xf * r1.float() + turned * r2.float()).to(x.dtype)


def npu_geglu(x: torch.Tensor, dim: int = -1, approximate: int = 1, activate_left: bool = False):
    """``y = a * gelu(b)`` (``activate_left=False``) with ``a, b = x.chunk(2, dim)``; returns ``(y, gelu(b))``."""
    a, b = x.float().chunk(2, dim=dim)
    if activate_left:
        a, b = b, a
    gelu = F.gelu(b, approximate="tanh" if approximate == 1 else "none")
    return (a * gelu).to(x.dtype), gelu.to(x.dtype)


def npu_gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU of ``x`` (``"none"``: erf, ``"tanh"``: the tanh form), computed in fp32, in x's dtype."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"npu_gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return F.gelu(x.float(), approximate=approximate).to(x.dtype)


def npu_moe_token_permute(tokens: torch.Tensor, indices: torch.Tensor, num_out_tokens: int | None = None,
                          padded_mode: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if padded_mode:
        raise NotImplementedError("padded_mode=True is not supported (as documented)")
    if indices.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"npu_moe_token_permute: indices must be int32 or int64, got {indices.dtype}")
    if tokens.dim() != 2:
        raise ValueError("npu_moe_token_permute: tokens must be 2-D (num_tokens, hidden_size)")
    topk = indices.shape[1] if indices.dim() == 2 else 1
    flat = indices.reshape(-1)
    sorted_indices = torch.argsort(torch.argsort(flat, stable=True), stable=True).to(torch.int32)
    source = torch.arange(flat.numel()) // topk
    gather = torch.empty_like(source)
    gather[sorted_indices.long()] = source
    permuted = tokens[gather]
    if num_out_tokens is not None and num_out_tokens > 0:
        permuted = permuted[:num_out_tokens]
    return permuted, sorted_indices


def npu_moe_token_unpermute(permuted_tokens: torch.Tensor, sorted_indices: torch.Tensor,
                            probs: torch.Tensor | None = None, padded_mode: bool = False,
                            restore_shape: tuple[int, ...] | None = None) -> torch.Tensor:
    if padded_mode:
        raise NotImplementedError("padded_mode=True is not supported (as documented)")
    if sorted_indices.dtype != torch.int32:
        raise TypeError("npu_moe_token_unpermute: sorted_indices must be int32")
    topk = probs.shape[1] if probs is not None else 1
    rows = permuted_tokens[sorted_indices.long()].float().view(-1, topk, permuted_tokens.shape[-1])
    if probs is not None:
        rows = rows * probs.float().unsqueeze(-1)
    return rows.sum(dim=1).to(permuted_tokens.dtype)


def npu_grouped_matmul(x: list[torch.Tensor], weight: list[torch.Tensor], *, bias: list[torch.Tensor] | None = None,
                       group_list: torch.Tensor | None = None, split_item: int = 0, group_type: int = -1,
                       group_list_type: int = 0, **unsupported: object) -> list[torch.Tensor]:
    if unsupported:
        raise NotImplementedError(f"the emulator does not implement {sorted(unsupported)}")
    if len(x) != 1 or len(weight) != 1 or weight[0].dim() != 3 or split_item not in (2, 3) or group_type != 0:
        raise NotImplementedError("the emulator implements one x [M, K], one weight [E, K, N], split_item 2/3, "
                                  "group_type 0")
    if group_list is None or group_list.dtype != torch.int64:
        raise TypeError("npu_grouped_matmul: group_list must be an int64 tensor")
    (xs,), (w,) = x, weight
    if xs.dtype != w.dtype:
        raise TypeError(f"npu_grouped_matmul: x {xs.dtype} and weight {w.dtype} must have one dtype")
    counts = group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        outs.append((xs[start:start + n].float() @ w[e].float()).to(xs.dtype))
        start += n
    if start != xs.shape[0]:
        raise ValueError(f"npu_grouped_matmul: group_list covers {start} rows, x has {xs.shape[0]}")
    y = torch.cat(outs)
    if bias is not None:
        raise NotImplementedError("the emulator does not implement bias")
    return [y]


def make_torch_npu() -> types.ModuleType:
    """A fresh ``torch_npu`` module object holding the emulated ops (and a spec, so find_spec works)."""
    module = types.ModuleType("torch_npu")
    module.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
    module.npu_rms_norm = npu_rms_norm  # type: ignore[attr-defined]
    module.npu_swiglu = npu_swiglu  # type: ignore[attr-defined]
    module.npu_rotary_mul = npu_rotary_mul  # type: ignore[attr-defined]
    module.npu_moe_token_permute = npu_moe_token_permute  # type: ignore[attr-defined]
    module.npu_moe_token_unpermute = npu_moe_token_unpermute  # type: ignore[attr-defined]
    module.npu_grouped_matmul = npu_grouped_matmul  # type: ignore[attr-defined]
    module.npu_geglu = npu_geglu  # type: ignore[attr-defined]
    module.npu_gelu = npu_gelu  # type: ignore[attr-defined]
    module.calls = []  # type: ignore[attr-defined]
    for name in EMULATED:
        setattr(module, name, _counted(module, getattr(module, name)))
    module.__getattr__ = _not_emulated  # type: ignore[attr-defined]
    return module


def _not_emulated(name: str) -> object:
    """What an op nobody emulates answers: an AttributeError that says so (PEP 562's module ``__getattr__``)."""
    if name.startswith("__"):
        raise AttributeError(name)
    raise AttributeError(f"torch_npu.{name} is not emulated on this machine (the emulator implements "
                         f"{', '.join(EMULATED)} from their documented contracts)")


@contextlib.contextmanager
def emulated_torch_npu() -> Iterator[types.ModuleType]:
    """``import torch_npu`` answers the emulator inside the block; the module table is put back after.

    Code imported inside the block keeps its reference to the emulator (a stack's kernel module
    binds ``torch_npu`` at import), so its kernels still reach it when they run later.
    """
    module = make_torch_npu()
    before = sys.modules.get("torch_npu")
    sys.modules["torch_npu"] = module
    try:
        yield module
    finally:
        if before is None:
            sys.modules.pop("torch_npu", None)
        else:
            sys.modules["torch_npu"] = before


def _counted(module: types.ModuleType, fn):  # type: ignore[no-untyped-def]
    def wrapper(*args, **kwargs):  # type: ignore[no-untyped-def]
        module.calls.append(fn.__name__)  # type: ignore[attr-defined]
        return fn(*args, **kwargs)

    wrapper.__name__ = fn.__name__
    return wrapper
