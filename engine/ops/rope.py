"""Rotary position embedding on q and k, in the four layouts transformers uses.

Targets a module-level function of the modeling module (``apply_rotary_pos_emb`` and its
relatives); each layout's reference follows transformers' expressions step for step:

================== ============================================ ==========================================
layout             function (transformers 5.24)                 computes
================== ============================================ ==========================================
half               ``apply_rotary_pos_emb(q, k, cos, sin,       ``x * cos + rotate_half(x) * sin``; partial
                   unsqueeze_dim=1)``: llama, qwen, Qwen-VL      rotary when cos is narrower than the head
                   text (mrope: sections merged into cos/sin)
half + upcast      ``apply_rotary_pos_emb_vision(q, k, cos,     the same in fp32 with ``cos.unsqueeze(-2)``,
                   sin)``: Qwen2-VL / 2.5-VL / 3-VL vision       cast back (declare ``unsqueeze_dim: -2``)
interleaved        GLM, GLM-4 ``apply_rotary_pos_emb``           pairs (x0, x1), ... rotated in place by
                                                                 ``cos[..., :d/2].repeat_interleave(2)``
interleaved_repeated Cohere, Cohere 2 ``apply_rotary_pos_emb``  pairs rotated in place by cos/sin already
                   (in fp32: declare ``upcast``)               repeated per pair (``repeat_interleave``)
interleaved_to_half DeepSeek-V3 ``apply_rotary_pos_emb_         interleaved pairs in, ``[evens | odds]`` out
                   interleave(q, k, cos, sin, position_ids,
                   unsqueeze_dim)``
complex            Llama 4 ``apply_rotary_emb(xq, xk,            pairs as complex numbers times
                   freqs_cis)``, ``vision_apply_rotary_emb``     ``freqs_cis``, in fp32, cast back
================== ============================================ ==========================================

The results keep the dtypes of q and k (olmo2 computes in fp32 and casts back; where
cos/sin already have q's dtype the cast is a no-op). Qwen2-VL's multimodal rope needs no
function of its own in transformers 5.x: the rotary embedding merges the t/h/w sections
into ``cos``/``sin`` and the attention calls the plain half-split function.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from engine.errors import SignatureMismatch
from engine.foundation.see_through import see_through
from engine.ops.base import FunctionOp, register_op
from engine.schema import RopeLayout, RopePatch

__all__ = [
    "RopeOp",
    "complex_rope_reference",
    "interleaved_repeated_rope_reference",
    "interleaved_rope_reference",
    "interleaved_to_half_rope_reference",
    "rope_reference",
    "rotate_half",
]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """GLM's rotate_half: ``(x0, x1), (x2, x3)...`` -> ``(-x1, x0), (-x3, x2)...``."""
    return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, turn: Callable[..., torch.Tensor]) -> torch.Tensor:
    rot = cos.shape[-1]
    if rot == x.shape[-1]:
        return (x * cos) + (turn(x) * sin)
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    return torch.cat(((x_rot * cos) + (turn(x_rot) * sin), x_pass), dim=-1)


def rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ground truth of the ``half`` layout (half-split rotate, optional partial rotary)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return _rotate(q, cos, sin, rotate_half).to(q.dtype), _rotate(k, cos, sin, rotate_half).to(k.dtype)


def upcast_rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = -2
) -> tuple[torch.Tensor, torch.Tensor]:
    """``half`` in fp32, cast back: the Qwen-VL ``apply_rotary_pos_emb_vision``."""
    cos, sin = cos.unsqueeze(unsqueeze_dim).float(), sin.unsqueeze(unsqueeze_dim).float()
    qf, kf = q.float(), k.float()
    return _rotate(qf, cos, sin, rotate_half).to(q.dtype), _rotate(kf, cos, sin, rotate_half).to(k.dtype)


def interleaved_rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``interleaved`` layout (GLM, GLM-4), partial rotary included."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    return _rotate(q, cos, sin, _rotate_pairs).to(q.dtype), _rotate(k, cos, sin, _rotate_pairs).to(k.dtype)


def upcast_interleaved_rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``interleaved`` in fp32, cast back (ERNIE 4.5): the pairs are turned in the input dtype and
    each term upcast, ``q.float() * cos + turn(q).float() * sin``, so that bf16 gradients round as
    the original's do (turning after the upcast gives the same forward but sums the gradient in fp32)."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1).float()
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1).float()

    def turn(x: torch.Tensor) -> torch.Tensor:
        rot = cos.shape[-1]
        x_rot = x[..., :rot]
        out = (x_rot.float() * cos) + (_rotate_pairs(x_rot).float() * sin)
        if rot < x.shape[-1]:
            out = torch.cat((out, x[..., rot:].float()), dim=-1)
        return out.to(x.dtype)

    return turn(q), turn(k)


def interleaved_repeated_rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``interleaved_repeated`` layout: pairs rotated in place by cos/sin that arrive repeated per
    pair (``repeat_interleave(freqs, 2)``: Cohere, Cohere 2), partial rotary included."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return _rotate(q, cos, sin, _rotate_pairs).to(q.dtype), _rotate(k, cos, sin, _rotate_pairs).to(k.dtype)


def upcast_interleaved_repeated_rope_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``interleaved_repeated`` in fp32, cast back: Cohere's ``q.float() * cos + rotate_half(q.float()) * sin``."""
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    qf, kf = q.float(), k.float()
    return _rotate(qf, cos, sin, _rotate_pairs).to(q.dtype), _rotate(kf, cos, sin, _rotate_pairs).to(k.dtype)


def interleaved_to_half_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    position_ids: torch.Tensor | None = None,
    unsqueeze_dim: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``interleaved_to_half`` layout (DeepSeek-V3 ``apply_rotary_pos_emb_interleave``)."""
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)

    def turn(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return turn(q), turn(k)


def _broadcast_freqs(freqs: torch.Tensor, xc: torch.Tensor, vision: bool) -> torch.Tensor:
    """Llama 4's two broadcasts: text ``freqs[:, :, None, :]`` for ``(batch, seq, d/2)`` frequencies,
    vision ``reshape_for_broadcast`` (``freqs_ci=``, or frequencies not shaped ``(batch, seq, d/2)``)."""
    text_shaped = freqs.dim() == 3 and freqs.shape[0] in (1, xc.shape[0]) and freqs.shape[1] == xc.shape[1]
    if text_shaped and not vision:
        return freqs[:, :, None, :]
    shape = [d if i == 1 or i == xc.dim() - 1 else 1 for i, d in enumerate(xc.shape)]
    return freqs.view(*shape).to(xc.device)


def complex_rope_reference(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cis: torch.Tensor | None = None, *, freqs_ci: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``complex`` layout (Llama 4 ``apply_rotary_emb``; ``freqs_ci=`` as its vision function names it)."""
    freqs = freqs_cis if freqs_cis is not None else freqs_ci
    if freqs is None:
        raise TypeError("complex rope needs freqs_cis")
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    f = _broadcast_freqs(freqs, xq_, vision=freqs_ci is not None)
    xq_out = torch.view_as_real(xq_ * f).flatten(3)
    xk_out = torch.view_as_real(xk_ * f).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def build_reference(patch: RopePatch | None) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The reference for the patch's layout, with the declared default ``unsqueeze_dim``."""
    if patch is None:
        return rope_reference
    if patch.layout is RopeLayout.complex:
        return complex_rope_reference
    if patch.layout is RopeLayout.interleaved_to_half:
        return interleaved_to_half_rope_reference
    base = {RopeLayout.half: upcast_rope_reference if patch.upcast else rope_reference,
            RopeLayout.interleaved: upcast_interleaved_rope_reference if patch.upcast else interleaved_rope_reference,
            RopeLayout.interleaved_repeated: upcast_interleaved_repeated_rope_reference if patch.upcast
            else interleaved_repeated_rope_reference}[patch.layout]

    default = patch.unsqueeze_dim
    if base.__defaults__ == (default,):  # type: ignore[attr-defined]
        return base

    def with_default(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     unsqueeze_dim: int = default) -> tuple[torch.Tensor, torch.Tensor]:
        return base(q, k, cos, sin, unsqueeze_dim)

    return with_default


#: The parameters each layout's function takes, in order (the kernel is called with the same arguments).
_EXPECTED: dict[RopeLayout, tuple[str, ...]] = {
    RopeLayout.half: ("q", "k", "cos", "sin"),
    RopeLayout.interleaved: ("q", "k", "cos", "sin"),
    RopeLayout.interleaved_repeated: ("q", "k", "cos", "sin"),
    RopeLayout.interleaved_to_half: ("q", "k", "cos", "sin", "position_ids", "unsqueeze_dim"),
}
_COMPLEX_NAMES = (("xq", "xk", "freqs_cis"), ("query", "key", "freqs_ci"))


def _what(value: object) -> str:
    """``the module torch``, ``the class Tensor``, ``an int``: what a name holds, for a message."""
    if inspect.ismodule(value):
        return f"the module {value.__name__}"
    if inspect.isclass(value):
        return f"the class {value.__name__}"
    kind = type(value).__name__
    return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind}"


@register_op
class RopeOp(FunctionOp):
    """Replace a rotary function of the modeling module (see the module docstring for the layouts)."""

    name = "rope"
    patch_type = RopePatch

    def reference(self, patch: RopePatch) -> Callable[..., Any]:
        return build_reference(patch)

    def check_function(self, function: Callable[..., object], patch: RopePatch) -> None:
        try:
            signature = inspect.signature(inspect.unwrap(see_through(function)))
        except (TypeError, ValueError):  # `function: torch` names the imported module: not a function to replace
            raise SignatureMismatch(
                f"rope cannot replace {patch.function!r}: the modeling module's {patch.function!r} is "
                f"{_what(function)}, not a rotary function; name the rotary function its attention calls "
                "(apply_rotary_pos_emb in most families)"
            ) from None
        params = list(signature.parameters)
        where = f"rope (layout: {patch.layout.value}) cannot replace {patch.function}({', '.join(params)})"
        if patch.layout is RopeLayout.complex:
            if tuple(params) not in _COMPLEX_NAMES:
                raise SignatureMismatch(
                    f"{where}: expected (xq, xk, freqs_cis) or (query, key, freqs_ci); "
                    "a function taking cos and sin is layout half or interleaved"
                )
            return
        expected = _EXPECTED[patch.layout]
        if tuple(params[: len(expected)]) != expected or len(params) > len(expected) + 1:
            hint = " (a function taking freqs_cis is layout complex)" if "freqs_cis" in params else ""
            raise SignatureMismatch(f"{where}: expected ({', '.join(expected)}, unsqueeze_dim=...){hint}")
        extra = signature.parameters.get("unsqueeze_dim")
        if extra is None and len(params) > len(expected):
            raise SignatureMismatch(f"{where}: its parameter {params[-1]!r} has no counterpart in the kernel")
        if extra is not None and extra.default != patch.unsqueeze_dim:
            raise SignatureMismatch(
                f"{where}: its unsqueeze_dim defaults to {extra.default!r}, the patch declares "
                f"unsqueeze_dim: {patch.unsqueeze_dim}; declare unsqueeze_dim: {extra.default}"
            )

    def alternatives(self, patch: RopePatch) -> Iterator[tuple[str, RopePatch]]:
        if patch.layout in (RopeLayout.half, RopeLayout.interleaved):
            other = RopeLayout.interleaved if patch.layout is RopeLayout.half else RopeLayout.half
            yield f"layout: {other.value}", patch.model_copy(update={"layout": other})
        yield f"upcast: {not patch.upcast}".lower(), patch.model_copy(update={"upcast": not patch.upcast})

    def candidates(self, name: str, function: Callable[..., Any]) -> Iterator[RopePatch]:
        """Every layout (and, for half and interleaved, fp32 or not) whose signature ``function`` has.

        ``unsqueeze_dim`` is the function's own default; a function without the parameter is
        taken as the vision kind (``-2``), as every one in transformers is.
        """
        signature = inspect.signature(inspect.unwrap(see_through(function)))
        param = signature.parameters.get("unsqueeze_dim")
        unsqueeze = param.default if param is not None and isinstance(param.default, int) else -2
        for layout in RopeLayout:
            if layout in (RopeLayout.interleaved_to_half, RopeLayout.complex):
                patch = RopePatch(op="rope", function=name, layout=layout)
                if self.accepts(name, function, patch):
                    yield patch
                continue
            for upcast in (False, True):
                patch = RopePatch(op="rope", function=name, layout=layout, upcast=upcast, unsqueeze_dim=unsqueeze)
                if self.accepts(name, function, patch):
                    yield patch
