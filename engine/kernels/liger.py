"""Liger-Kernel (Triton) kernels for CUDA, imported only inside ``build``.

* ``rms_norm``: ``LigerRMSNormFunction.apply(x, w, eps, offset, casting_mode, in_place=False)``.
  ``offset`` is 1.0 for ``scale: one_plus_weight`` (liger adds it in fp32 inside the kernel,
  so ``1 + w`` is never rounded to bf16), else 0.0. ``casting_mode``: ``"llama"`` for our
  llama cast order (normalize in fp32, cast, multiply), ``"gemma"`` for the fp32 order or
  ``precision: fp32`` (everything in fp32, cast last). Never in place: liger's in-place
  backward overwrites ``dY``, which is wrong when the output feeds more than one consumer.
  Liger writes its output in the input's dtype; where transformers' llama order returns the
  promoted dtype instead (fp32 weight with bf16 input, or ``1 + w`` in llama order), the call
  runs the torch reference and warns once, because liger cannot produce that result.
* ``swiglu``: ``LigerSiLUMulFunction.apply(gate, up)``.
* ``rope``: ``LigerRopeFunction.apply(q, k, cos, sin, None, unsqueeze_dim)`` (partial rotary:
  liger rotates the first ``cos.shape[-1]`` features, like the reference). Liger reads only the
  first half of ``cos``/``sin``: it relies on transformers' ``cat(freqs, freqs)`` layout, which
  every half-split rotary embedding in transformers produces. Liger reads q and k as
  ``(batch, heads, seq, dim)`` whatever ``unsqueeze_dim`` says, so a call with ``unsqueeze_dim=2``
  (``(batch, seq, heads, dim)``: DeepSeek-V3.2's indexer) is transposed to that layout and back;
  another layout runs the reference. Called directly,
  not through liger's backend dispatcher, so that the kernel is the one this file names.
  ``upcast`` (the Qwen-VL vision functions): in fp32 and cast back, with ``(seq, heads, dim)``
  transposed to liger's ``(1, heads, seq, dim)`` as liger's ``liger_rotary_pos_emb_vision`` does.
  ``layout: complex`` (Llama 4): ``LigerLlama4RopeFunction`` where its frequencies are shared
  by the batch (``freqs_cis`` of shape ``(1, seq, d/2)``): liger reads one row per position, so
  per-sequence frequencies (per-row position ids) and the vision broadcast run the reference.
  The interleaved layouts have no liger kernel: refused, ``auto`` picks torch.
* ``geglu``: ``LigerGELUMulFunction.apply(gate, up)`` (tanh GELU only; ``approximate: none``
  is refused).
* ``layer_norm``: ``LigerLayerNormFunction.apply(x, w, b, eps)``; ``1 + w`` formed as the
  reference forms it (in the weight's dtype, as Nemotron), a missing bias passed as zeros and
  a missing weight as ones (OLMo 1; liger's kernel always reads both). Its kernel computes
  ``(x - mean) * rstd * w + b`` in fp32 and rounds once, which is both forms (``functional``,
  ``centered``: Cohere) and ``precision: fp32``; a per-head weight (Cohere's q/k norms) is refused.
* ``mlp`` (no gate): ``LigerReLUSquaredFunction`` for ``relu2`` (Nemotron-H); liger has no
  kernel for the other activations of an ungated MLP (its GELU kernel is GeGLU's gated one).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from engine.kernels.registry import Dependency, KernelProvider, register
from engine.ops.rms_norm import rms_norm_reference
from engine.schema import CastOrder, Device, GeluApproximate, MlpActivation, Precision, RopeLayout, RopePatch, Scale

__all__ = ["LIGER", "liger_rms_norm_arguments"]

LIGER = Dependency("liger_kernel", "liger-kernel", "cuda")
_CUDA = frozenset({Device.cuda})


def liger_rms_norm_arguments(scale: Scale, cast: CastOrder, precision: Precision) -> tuple[float, str]:
    """``(offset, casting_mode)`` for liger's RMSNorm that reproduce the declared numerics."""
    offset = 1.0 if scale is Scale.one_plus_weight else 0.0
    mode = "llama" if cast is CastOrder.llama and precision is Precision.native else "gemma"
    return offset, mode


def _build_rms_norm(patch: Any) -> Callable[..., torch.Tensor]:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    offset, mode = liger_rms_norm_arguments(patch.scale, patch.cast, patch.precision)
    warned: list[bool] = []

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if mode == "llama" and torch.promote_types(weight.dtype, x.dtype) != x.dtype:
            if not warned:
                warned.append(True)
                warnings.warn(
                    f"liger rms_norm: transformers' llama cast order returns {torch.promote_types(weight.dtype, x.dtype)} "
                    f"for a {weight.dtype} weight and {x.dtype} input, which liger cannot produce; "
                    "these calls run the torch reference",
                    stacklevel=2,
                )
            return rms_norm_reference(x, weight, eps, scale=patch.scale, cast=patch.cast, precision=patch.precision)
        return LigerRMSNormFunction.apply(x, weight, eps, offset, mode, False)

    return rms_norm


def _rms_norm_supports(patch: Any) -> str | None:
    if patch.scale is Scale.one_plus_weight and patch.cast is CastOrder.llama and patch.precision is Precision.native:
        return "scale one_plus_weight with cast llama returns fp32 in transformers; liger returns the input dtype"
    return None


def _build_swiglu(patch: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return LigerSiLUMulFunction.apply(gate, up)

    return silu_mul


def _build_geglu(patch: Any) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    from liger_kernel.ops.geglu import LigerGELUMulFunction

    def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return LigerGELUMulFunction.apply(gate, up)

    return gelu_mul


def _geglu_supports(patch: Any) -> str | None:
    if patch.approximate is not GeluApproximate.tanh:
        return "LigerGELUMulFunction computes the tanh GELU only"
    return None


@functools.lru_cache(maxsize=64)
def _zeros(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype, device=device)


def _build_layer_norm(patch: Any) -> Callable[..., torch.Tensor]:
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction

    from engine.ops.layer_norm import layer_norm_weight

    scale = patch.scale

    def layer_norm(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
        if weight is None:  # OLMo 1: no parameters; liger's kernel always reads a weight and a bias
            weight = _ones(x.shape[-1], x.dtype, x.device)
        if bias is None:
            bias = _zeros(weight.shape[0], weight.dtype, weight.device)
        return LigerLayerNormFunction.apply(x, layer_norm_weight(weight, scale), bias, eps)

    return layer_norm


def _layer_norm_supports(settings: Any) -> str | None:
    if getattr(settings, "per_head", False):
        return "LigerLayerNormFunction takes a 1-d weight; a per-head (heads, head_dim) weight is not mapped"
    return None


@functools.lru_cache(maxsize=64)
def _ones(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.ones(n, dtype=dtype, device=device)


def _build_mlp(patch: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    from liger_kernel.ops.relu_squared import LigerReLUSquaredFunction

    def relu_squared(h: torch.Tensor) -> torch.Tensor:
        return LigerReLUSquaredFunction.apply(h)

    return relu_squared


def _mlp_supports(patch: Any) -> str | None:
    if patch.activation is not MlpActivation.relu2:
        return f"liger has no kernel for an ungated {patch.activation.value} MLP (LigerReLUSquaredFunction: relu2 only)"
    return None


def _build_rope(patch: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    patch = patch or RopePatch(op="rope")
    if patch.layout is RopeLayout.complex:
        from liger_kernel.ops.llama4_rope import LigerLlama4RopeFunction

        from engine.ops.rope import complex_rope_reference

        def complex_rope(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor | None = None, *,
                         freqs_ci: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
            # liger reads one row of frequencies per position, shared by the batch: frequencies
            # that differ per sequence (per-row position ids) and the vision broadcast run the reference.
            if freqs_ci is not None or freqs_cis is None or freqs_cis.dim() != 3 or freqs_cis.shape[0] != 1:
                return complex_rope_reference(xq, xk, freqs_cis, freqs_ci=freqs_ci)
            return LigerLlama4RopeFunction.apply(xq, xk, freqs_cis)

        return complex_rope
    from liger_kernel.ops.rope import LigerRopeFunction

    from engine.ops.rope import rope_reference

    default, upcast = patch.unsqueeze_dim, patch.upcast

    def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             unsqueeze_dim: int = default) -> tuple[torch.Tensor, torch.Tensor]:
        if not upcast:
            if q.dim() == 4 and unsqueeze_dim in (2, -2):
                # (batch, seq, heads, dim), as DeepSeek-V3.2's indexer calls it: liger reads (batch, heads, seq,
                # dim) whatever unsqueeze_dim says (interpreted, the unswapped call wrote outside q)
                qo, ko = LigerRopeFunction.apply(q.transpose(1, 2), k.transpose(1, 2), cos, sin, None, 1)
                return qo.transpose(1, 2), ko.transpose(1, 2)
            if q.dim() != 4 or unsqueeze_dim not in (1, -3):
                return rope_reference(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)
            return LigerRopeFunction.apply(q, k, cos, sin, None, unsqueeze_dim)
        # (seq, heads, dim) with cos (seq, dim) unsqueezed at -2: liger wants (1, heads, seq, dim).
        q32 = q.float().unsqueeze(0).transpose(1, 2)
        k32 = k.float().unsqueeze(0).transpose(1, 2)
        qo, ko = LigerRopeFunction.apply(q32, k32, cos.float(), sin.float(), None, 1)
        return qo.transpose(1, 2).squeeze(0).to(q.dtype), ko.transpose(1, 2).squeeze(0).to(k.dtype)

    return rope


def _rope_supports(patch: Any) -> str | None:
    if patch.layout in (RopeLayout.interleaved, RopeLayout.interleaved_to_half, RopeLayout.interleaved_repeated):
        return f"liger has no kernel for the {patch.layout.value} rotary layout"
    if patch.upcast and patch.unsqueeze_dim != -2:
        return "liger's fp32 rotary path is the vision layout (seq, heads, dim) with unsqueeze_dim -2 only"
    return None


_COMMON: dict[str, Any] = {"devices": _CUDA, "requires": (LIGER,), "has_backward": True, "compile_safe": True}

register(KernelProvider(name="liger", op="rms_norm", build=_build_rms_norm, supports=_rms_norm_supports,
                        description="LigerRMSNormFunction (offset, casting mode; never in place)", **_COMMON))
register(KernelProvider(name="liger", op="swiglu", build=_build_swiglu,
                        description="LigerSiLUMulFunction", **_COMMON))
register(KernelProvider(name="liger", op="rope", build=_build_rope, supports=_rope_supports,
                        description="LigerRopeFunction (half layout), LigerLlama4RopeFunction (complex)", **_COMMON))
register(KernelProvider(name="liger", op="geglu", build=_build_geglu, supports=_geglu_supports,
                        description="LigerGELUMulFunction (tanh GELU)", **_COMMON))
register(KernelProvider(name="liger", op="layer_norm", build=_build_layer_norm, supports=_layer_norm_supports,
                        description="LigerLayerNormFunction (both forms: it computes in fp32, rounds once)", **_COMMON))
register(KernelProvider(name="liger", op="mlp", build=_build_mlp, supports=_mlp_supports,
                        description="LigerReLUSquaredFunction (relu2)", **_COMMON))
