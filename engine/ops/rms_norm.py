"""RMSNorm: ``x_hat = x * rsqrt(mean(x^2, -1) + eps)``, scaled by ``w`` or ``1 + w``.

The reference follows transformers' own expressions step for step, so that in bf16 it is
bit-for-bit equal to the module it replaces when the declared cast order is the module's:

* ``llama``: ``w * x_hat.to(in_dtype)``: normalize in fp32, cast, multiply (the result
  dtype is the promotion of the weight and input dtypes, as in transformers);
* ``fp32``: ``(w.float() * x_hat).to(in_dtype)``: multiply in fp32, cast last (gemma, olmo2).

``1 + w`` is always formed in fp32 (``weight.float() + 1``), never in the weight's dtype:
in bf16, ``1 + 0.011`` rounds to ``1.0078125``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn

from engine.ops.base import (
    ModuleOp,
    norm_parameter_names,
    register_op,
    require_norm_attributes,
    require_norm_eps,
    require_single_input,
)
from engine.schema import CastOrder, Precision, RmsNormPatch, Scale

__all__ = ["RmsNormOp", "effective_weight", "rms_norm_reference"]


def effective_weight(weight: torch.Tensor, scale: Scale) -> torch.Tensor:
    """The factor the normalized input is multiplied by: ``w``, or ``1 + w`` formed in fp32."""
    return weight.float() + 1.0 if scale is Scale.one_plus_weight else weight


def rms_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    scale: Scale = Scale.weight,
    cast: CastOrder = CastOrder.llama,
    precision: Precision = Precision.native,
) -> torch.Tensor:
    """The ground truth of the ``rms_norm`` op (see the module docstring for the cast orders)."""
    in_dtype = x.dtype
    xf = x.to(torch.float32)
    x_hat = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = effective_weight(weight, scale)
    if cast is CastOrder.llama and precision is Precision.native:
        return w * x_hat.to(in_dtype)
    return (w.to(torch.float32) * x_hat).to(in_dtype)


def _build_torch(patch: RmsNormPatch) -> Callable[..., torch.Tensor]:
    return partial(rms_norm_reference, scale=patch.scale, cast=patch.cast, precision=patch.precision)


@register_op
class RmsNormOp(ModuleOp):
    """Replace an RMSNorm module's forward with ``kernel(x, weight, eps)``."""

    name = "rms_norm"
    patch_type = RmsNormPatch
    declared_settings = ("scale", "eps_attr", "cast")

    def reference(self, patch: RmsNormPatch) -> Callable[..., Any]:
        return _build_torch(patch)

    def check_target(self, module: nn.Module, patch: RmsNormPatch) -> None:
        require_single_input(module, self.name, forbid=("gate",))
        if not patch.weight_required and _weightless(module, patch):
            require_norm_eps(module, patch.eps_attr)
            return
        require_norm_attributes(module, patch.eps_attr, patch.weight_attr)

    def bind(self, module: nn.Module, patch: RmsNormPatch, impl: Callable[..., Any]) -> Callable[..., Any]:
        # eps and the weight are read from the module on every call, never captured here: a user
        # who sets `module.variance_epsilon` after apply gets what the original forward would
        # compute (one attribute read, ~20 ns; see docs/performance.md).
        eps_attr, weight_attr = patch.eps_attr, patch.weight_attr
        if not patch.weight_required and _weightless(module, patch):
            # the unit factor in the input's dtype: x_hat times exactly 1 (w = 0 where 1 + w), so every
            # kernel computes the weightless norm bit for bit with the weight it takes anyway
            fill = 0.0 if patch.scale is Scale.one_plus_weight else 1.0

            def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
                unit = torch.full(hidden_states.shape[-1:], fill, dtype=hidden_states.dtype, device=hidden_states.device)
                return impl(hidden_states, unit, getattr(self, eps_attr))

        elif (eps_attr, weight_attr) == ("variance_epsilon", "weight"):

            def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
                return impl(hidden_states, self.weight, self.variance_epsilon)

        else:

            def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
                return impl(hidden_states, getattr(self, weight_attr), getattr(self, eps_attr))

        return forward

    def alternatives(self, patch: RmsNormPatch) -> Iterator[tuple[str, RmsNormPatch]]:
        # Labels name only what differs from the declaration: "scale: weight fits".
        for scale, cast in itertools.product(Scale, CastOrder):
            if (scale, cast) != (patch.scale, patch.cast):
                alt = patch.model_copy(update={"scale": scale, "cast": cast, "precision": Precision.native})
                changed = [f"scale: {scale.value}"] if scale != patch.scale else []
                changed += [f"cast: {cast.value}"] if cast != patch.cast else []
                yield ", ".join(changed), alt


    def candidates(self, module: nn.Module) -> Iterator[RmsNormPatch]:
        """Every (weight, eps attribute, scale, cast) a norm-shaped module could be declared with.

        A module with an eps but no weight (Gemma 3n's value norm beside its class's weighted
        ones) gets the declarations with ``weight_required: false`` and the default weight name:
        measured on every instance of the class, they are exact only where the weighted ones are too.
        """
        weights, eps_attrs = norm_parameter_names(module)
        target = type(module).__name__
        if not weights and eps_attrs and not any(True for _ in module.parameters(recurse=False)):
            for eps_attr, scale, cast in itertools.product(eps_attrs, Scale, CastOrder):
                yield RmsNormPatch(op="rms_norm", target=target, scale=scale, cast=cast, eps_attr=eps_attr,
                                   weight_required=False)
            return
        for weight_attr, eps_attr, scale, cast in itertools.product(weights, eps_attrs, Scale, CastOrder):
            yield RmsNormPatch(
                op="rms_norm", target=target, scale=scale, cast=cast, eps_attr=eps_attr, weight_attr=weight_attr
            )


def _weightless(module: nn.Module, patch: RmsNormPatch) -> bool:
    """Whether this instance has no weight under ``weight_attr`` (Gemma 3n's ``with_scale=False`` norm)."""
    return getattr(module, patch.weight_attr, None) is None
