"""Rotary position embedding: ``x * cos + rotate_half(x) * sin`` for q and k.

Targets the modeling module's ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``.
The results keep the dtypes of q and k (olmo2 computes in fp32 and casts back).
The reference also handles partial rotary (``cos`` narrower than the head): the first
``cos.shape[-1]`` features are rotated and the rest pass through, as in qwen3_next.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from engine.errors import SignatureMismatch
from engine.ops.base import FunctionOp, register_op
from engine.schema import RopePatch

__all__ = ["RopeOp", "rope_reference", "rotate_half"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return (x * cos) + (rotate_half(x) * sin)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat(((x_rot * cos) + (rotate_half(x_rot) * sin), x_pass), dim=-1)


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ground truth of the ``rope`` op (half-split rotate, optional partial rotary)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    # Results keep q's and k's dtypes: olmo2's cos/sin stay fp32 in a bf16 model and it casts
    # back; where cos/sin already have q's dtype (llama), the cast is a no-op.
    return _rotate(q, cos, sin).to(q.dtype), _rotate(k, cos, sin).to(k.dtype)


_EXPECTED = ("q", "k", "cos", "sin")


@register_op
class RopeOp(FunctionOp):
    """Replace ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``."""

    name = "rope"
    patch_type = RopePatch

    def reference(self, patch: RopePatch) -> Callable[..., Any]:
        return rope_reference

    def check_function(self, function: Callable[..., object], patch: RopePatch) -> None:
        params = list(inspect.signature(inspect.unwrap(function)).parameters)
        if tuple(params[:4]) != _EXPECTED:
            raise SignatureMismatch(
                f"rope cannot replace {patch.function}({', '.join(params)}): "
                f"expected ({', '.join(_EXPECTED)}, unsqueeze_dim=1)"
            )

    def candidates(self, name: str, function: Callable[..., object]) -> Iterator[RopePatch]:
        patch = RopePatch(op="rope", function=name)
        if self.accepts(name, function, patch):
            yield patch
