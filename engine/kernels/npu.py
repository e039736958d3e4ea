"""Ascend NPU kernels from ``torch_npu``, imported only inside ``build`` (never at engine import).

Op contracts used (``torch_npu/_op_plugin_docs.py``):

* ``npu_rms_norm(x, gamma, epsilon) -> (y, rstd)``: ``y = x * rsqrt(mean(x^2) + eps) * gamma``.
  Assumed, as for every fused vendor norm: computed in fp32 and rounded once to ``x.dtype``;
  ``gamma`` in ``x``'s dtype.
* ``npu_swiglu(x, dim=-1)``: ``silu(a) * b`` with ``a, b = x.chunk(2, dim)``.
* ``npu_rotary_mul(x, r1, r2, rotary_mode)``: ``half``: ``x * r1 + cat(-x2, x1) * r2`` (x1, x2
  the halves); ``interleave``: ``x * r1 + stack(-x_odd, x_even).flatten(-2) * r2`` (GLM's
  layout, with ``r1``/``r2`` repeated per pair; Cohere's ``interleaved_repeated`` passes its
  already repeated cos/sin as they are); 4-D inputs.
* ``npu_gelu(x, approximate="none")``: GELU, ``"none"`` the erf form, ``"tanh"`` the tanh form
  (the ``mlp`` op's ``gelu`` and ``gelu_tanh``; torch's own ``gelu`` on an NPU ignores ``approximate``).
* ``npu_geglu(x, dim=-1, approximate=1) -> (y, gelu)``: ``x`` split in halves ``a, b`` along
  ``dim``, ``y = a * gelu(b)`` (``activate_left=False``, the default: the right half is
  activated); ``approximate`` 1 is tanh, 0 is erf.

How each cast order of ``rms_norm`` is reproduced (the arguments are chosen so that the
fused op rounds exactly where transformers rounds):

* ``llama`` (``w * x_hat.to(in_dtype)``): in fp32 the order does not matter, so
  ``npu_rms_norm(x, w.float())``; in bf16/fp16 the op normalizes with ``gamma = 1`` (giving
  ``x_hat`` rounded to the input dtype, as transformers does) and the weight multiply runs
  after it in torch, in the dtype torch promotes to, exactly as in transformers.
* ``fp32`` (``(w.float() * x_hat).to(in_dtype)``) or ``precision: fp32``: when the weight is
  exact in the input dtype (``scale: weight``, same dtype) the op takes it directly: one
  fused call, one rounding. ``1 + w`` is formed in fp32 and is not exact in bf16
  (``1 + 0.011`` rounds to ``1.0078125``), so then the op runs on ``x.float()`` with the fp32
  ``1 + w`` and the result is cast once: correct, at the cost of an fp32 copy of ``x``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from engine.kernels.registry import Dependency, KernelProvider, register
from engine.ops.rms_norm import effective_weight
from engine.schema import CastOrder, Device, Precision, RopeLayout, RopePatch, Scale

__all__ = ["NPU_DEVICES", "TORCH_NPU", "npu_rms_norm_kernel"]

TORCH_NPU = Dependency(
    "torch_npu",
    "torch-npu",
    "npu",
    broken_hint=(
        "torch_npu needs Huawei's CANN toolkit on the library path (e.g. "
        "`source /usr/local/Ascend/ascend-toolkit/set_env.sh`); on a machine without an NPU, "
        "uninstall torch-npu"
    ),
)
NPU_DEVICES = frozenset({Device.npu})


def _torch_npu() -> Any:
    import torch_npu

    return torch_npu


@functools.lru_cache(maxsize=64)
def _ones(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The ``gamma = 1`` of the llama order, made once per (width, dtype, device), not per call."""
    return torch.ones(n, dtype=dtype, device=device)


def npu_rms_norm_kernel(
    npu: Any, scale: Scale, cast: CastOrder, precision: Precision
) -> Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]:
    """``rms_norm(x, weight, eps)`` through ``npu.npu_rms_norm`` with the declared rounding."""
    llama = cast is CastOrder.llama and precision is Precision.native

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        in_dtype = x.dtype
        if llama:
            if in_dtype == torch.float32:
                return npu.npu_rms_norm(x, effective_weight(weight, scale).float(), eps)[0]
            ones = _ones(x.shape[-1], in_dtype, x.device)
            return effective_weight(weight, scale) * npu.npu_rms_norm(x, ones, eps)[0]
        if scale is Scale.weight and weight.dtype == in_dtype:
            return npu.npu_rms_norm(x, weight, eps)[0]
        return npu.npu_rms_norm(x.float(), effective_weight(weight, scale).float(), eps)[0].to(in_dtype)

    return rms_norm


def _build_rms_norm(patch: Any) -> Callable[..., torch.Tensor]:
    return npu_rms_norm_kernel(_torch_npu(), patch.scale, patch.cast, patch.precision)


def _build_swiglu(patch: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    npu = _torch_npu()

    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return npu.npu_swiglu(torch.cat([gate, up], dim=-1), dim=-1)

    return silu_mul


def _build_rope(patch: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    npu = _torch_npu()
    patch = patch or RopePatch(op="rope")
    interleaved = patch.layout is RopeLayout.interleaved
    mode = "interleave" if patch.layout in (RopeLayout.interleaved, RopeLayout.interleaved_repeated) else "half"
    default, upcast = patch.unsqueeze_dim, patch.upcast

    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        squeeze = x.dim() == 3  # the vision functions' (seq, heads, dim): npu_rotary_mul wants 4-D
        if squeeze:
            x, cos, sin = x.unsqueeze(0), cos.unsqueeze(0), sin.unsqueeze(0)
        rot = cos.shape[-1]
        out = npu.npu_rotary_mul(x[..., :rot], cos, sin, rotary_mode=mode)
        if rot != x.shape[-1]:
            out = torch.cat((out, x[..., rot:]), dim=-1)
        return out.squeeze(0) if squeeze else out

    def rope(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = default
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        if interleaved:  # GLM: the first half of cat(freqs, freqs), each angle repeated for its pair
            cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
            sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
        if upcast:
            qf, kf, cos, sin = q.float(), k.float(), cos.float(), sin.float()
            return rotate(qf, cos, sin).to(q.dtype), rotate(kf, cos, sin).to(k.dtype)
        return rotate(q, cos, sin), rotate(k, cos, sin)

    return rope


def _rope_supports(patch: Any) -> str | None:
    if patch.layout not in (RopeLayout.half, RopeLayout.interleaved, RopeLayout.interleaved_repeated):
        return f"npu_rotary_mul has no {patch.layout.value} mode (only half and interleave)"
    return None


def _build_geglu(patch: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``npu_geglu(cat([up, gate]), approximate)``: it splits in halves and applies GELU to the second."""
    npu = _torch_npu()
    approximate = 1 if patch.approximate.value == "tanh" else 0

    def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return npu.npu_geglu(torch.cat([up, gate], dim=-1), dim=-1, approximate=approximate)[0]

    return gelu_mul


def _build_mlp(patch: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """``npu_gelu(h, approximate)``: the erf GELU (``none``) or ``F.gelu``'s tanh form (``tanh``)."""
    npu = _torch_npu()
    approximate = "tanh" if patch.activation.value == "gelu_tanh" else "none"

    def gelu(h: torch.Tensor) -> torch.Tensor:
        return npu.npu_gelu(h, approximate=approximate)

    return gelu


def _mlp_supports(patch: Any) -> str | None:
    if patch.activation.value not in ("gelu", "gelu_tanh"):
        return f"torch_npu documents no fused {patch.activation.value} (npu_gelu: gelu and gelu_tanh only)"
    return None


def _build_gated_rms_norm(patch: Any) -> Callable[..., torch.Tensor]:
    """``npu_rms_norm`` (rounded as the cast order says), then ``act(gate)`` in fp32, as transformers."""
    npu = _torch_npu()
    act = torch.sigmoid if patch.activation.value == "sigmoid" else torch.nn.functional.silu
    llama = patch.cast is CastOrder.llama and patch.precision is Precision.native
    norm = npu_rms_norm_kernel(npu, patch.scale, patch.cast, patch.precision)

    def gated(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, eps: float,
              group_size: int | None = None) -> torch.Tensor:
        in_dtype = x.dtype
        if gate is None:
            return norm(x, weight, eps)
        if llama:  # G_QNEXT: (w * x_hat.to(in) * act(gate.float())).to(in)
            return (norm(x, weight, eps) * act(gate.float())).to(in_dtype)
        # fp32 order: (w.float() * x_hat * act(gate.float())).to(in), one rounding at the end
        y = npu.npu_rms_norm(x.float(), effective_weight(weight, patch.scale).float(), eps)[0]
        return (y * act(gate.float())).to(in_dtype)

    return gated


def _gated_supports(patch: Any) -> str | None:
    if getattr(patch, "order", None) is not None and patch.order.value != "norm_then_gate":
        return "npu_rms_norm normalizes first; order gate_then_norm is not mapped"
    if any(getattr(patch, k, None) is not None for k in ("group_size", "group_size_attr", "num_groups_attr")):
        return "npu_rms_norm normalizes the whole last dimension; group-wise norms are not mapped"
    return None


_COMMON: dict[str, Any] = {"devices": NPU_DEVICES, "requires": (TORCH_NPU,), "has_backward": True, "compile_safe": True}

register(KernelProvider(name="npu", op="rms_norm", build=_build_rms_norm,
                        description="torch_npu.npu_rms_norm", **_COMMON))
register(KernelProvider(name="npu", op="swiglu", build=_build_swiglu,
                        description="torch_npu.npu_swiglu on cat([gate, up], -1)", **_COMMON))
register(KernelProvider(name="npu", op="rope", build=_build_rope, supports=_rope_supports,
                        description="torch_npu.npu_rotary_mul (half and interleave modes)", **_COMMON))
register(KernelProvider(name="npu", op="geglu", build=_build_geglu,
                        description="torch_npu.npu_geglu on cat([up, gate], -1)", **_COMMON))
register(KernelProvider(name="npu", op="gated_rms_norm", build=_build_gated_rms_norm, supports=_gated_supports,
                        description="torch_npu.npu_rms_norm, then act(gate) in fp32", **_COMMON))
register(KernelProvider(name="npu", op="mlp", build=_build_mlp, supports=_mlp_supports,
                        description="torch_npu.npu_gelu (gelu, gelu_tanh)", **_COMMON))
