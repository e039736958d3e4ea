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
  every half-split rotary embedding in transformers produces. Called directly,
  not through liger's backend dispatcher, so that the kernel is the one this file names.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from engine.kernels.registry import Dependency, KernelProvider, register
from engine.ops.rms_norm import rms_norm_reference
from engine.schema import CastOrder, Device, Precision, Scale

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


def _build_rope(patch: Any) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    from liger_kernel.ops.rope import LigerRopeFunction

    def rope(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return LigerRopeFunction.apply(q, k, cos, sin, None, unsqueeze_dim)

    return rope


_COMMON: dict[str, Any] = {"devices": _CUDA, "requires": (LIGER,), "has_backward": True, "compile_safe": True}

register(KernelProvider(name="liger", op="rms_norm", build=_build_rms_norm, supports=_rms_norm_supports,
                        description="LigerRMSNormFunction (offset, casting mode; never in place)", **_COMMON))
register(KernelProvider(name="liger", op="swiglu", build=_build_swiglu,
                        description="LigerSiLUMulFunction", **_COMMON))
register(KernelProvider(name="liger", op="rope", build=_build_rope,
                        description="LigerRopeFunction", **_COMMON))
