"""Gated RMSNorm: an RMSNorm combined with ``act(gate)``, the output norm of linear attention.

transformers has five numerically different gated norms (reference file, section 3). The
settings of :class:`~engine.schema.GatedRmsNormPatch` reproduce each of them bit-for-bit in
bf16, following transformers' own expressions step for step:

=============  ==========  ==============  ==========  ============================================
formula        activation  order           cast        classes
=============  ==========  ==============  ==========  ============================================
G_QNEXT        silu        norm_then_gate  llama       Qwen3Next/Qwen3_5/Qwen3_5Moe/OlmoHybrid...Gated
G_F32W_SIG     sigmoid     norm_then_gate  fp32        KimiLinear/BailingHybrid/Glm5NextText...Gated
G_F32W_SILU    silu        norm_then_gate  fp32        LaraMiniRMSNormGated
G_MAMBA2       silu        gate_then_norm  llama       Mamba/Bamba/GraniteMoeHybrid/NemotronH/Zamba2
                                                       (+ ``group_size_attr: group_size``)
G_FALCONH1     silu        either          fp32        FalconH1RMSNormGated (+ ``num_groups_attr``)
=============  ==========  ==============  ==========  ============================================

In every variant the gate's activation runs in fp32 (``act(gate.float())``), and
``1 + w`` (if declared) is formed in fp32. The cast orders:

* ``llama``: ``w * x_hat.to(in_dtype)``; a gate applied after the norm then multiplies in
  fp32 and the product is cast to the input dtype (G_QNEXT). With the gate before the norm
  there is no final cast, as in mamba2 (the result dtype is the promotion of ``w`` and x).
* ``fp32`` (or ``precision: fp32``): ``(w.float() * x_hat [* act(gate)]).to(in_dtype)``.

The kernel signature is ``impl(x, gate, weight, eps, group_size=None)``; ``gate=None``
means no gating (the bound forward raises before that when the gate is required).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
from torch import nn

from engine.errors import SignatureMismatch
from engine.ops.base import (
    ModuleOp,
    describe_signature,
    forward_parameters,
    norm_parameter_names,
    register_op,
    require_norm_attributes,
)
from engine.ops.rms_norm import effective_weight
from engine.schema import Activation, CastOrder, GatedRmsNormPatch, GateOrder, Precision, Scale

__all__ = ["GATE_PARAM", "GatedRmsNormOp", "gate_missing_message", "gated_rms_norm_reference"]

#: The name of the gate parameter in every gated norm of transformers 5.24 (16 classes).
GATE_PARAM = "gate"

_ACTIVATIONS: dict[Activation, Callable[[torch.Tensor], torch.Tensor]] = {
    Activation.silu: torch.nn.functional.silu,
    Activation.sigmoid: torch.sigmoid,
}


def gate_missing_message(cls_name: str) -> str:
    """The runtime error for a required gate that is ``None`` (a fixed contract, tested verbatim)."""
    return f"{cls_name} requires a gate tensor for gated RMSNorm."


def _normalize(xf: torch.Tensor, eps: float, group_size: int | None) -> torch.Tensor:
    """``xf * rsqrt(mean(xf^2) + eps)`` over the last dim, or over groups of ``group_size`` features."""
    if group_size is None or group_size == xf.shape[-1]:
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    *prefix, last = xf.shape
    grouped = xf.view(*prefix, last // group_size, group_size)
    grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return grouped.view(*prefix, last)


def gated_rms_norm_reference(
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    group_size: int | None = None,
    *,
    scale: Scale = Scale.weight,
    activation: Activation = Activation.silu,
    order: GateOrder = GateOrder.norm_then_gate,
    cast: CastOrder = CastOrder.llama,
    precision: Precision = Precision.native,
) -> torch.Tensor:
    """The ground truth of the ``gated_rms_norm`` op (see the module docstring)."""
    in_dtype = x.dtype
    act = _ACTIVATIONS[activation]
    xf = x.to(torch.float32)
    if gate is not None and order is GateOrder.gate_then_norm:
        xf = xf * act(gate.to(torch.float32))
    x_hat = _normalize(xf, eps, group_size)
    w = effective_weight(weight, scale)
    gate_after = gate is not None and order is GateOrder.norm_then_gate
    if cast is CastOrder.llama and precision is Precision.native:
        y = w * x_hat.to(in_dtype)
        if not gate_after:
            return y
        return (y * act(gate.to(torch.float32))).to(in_dtype)  # type: ignore[union-attr]
    y = w.to(torch.float32) * x_hat
    if gate_after:
        y = y * act(gate.to(torch.float32))  # type: ignore[union-attr]
    return y.to(in_dtype)


def _build_torch(patch: GatedRmsNormPatch) -> Callable[..., torch.Tensor]:
    return partial(
        gated_rms_norm_reference,
        scale=patch.scale,
        activation=patch.activation,
        order=patch.order,
        cast=patch.cast,
        precision=patch.precision,
    )


def _group_size(module: nn.Module, patch: GatedRmsNormPatch, width: int) -> int | None:
    """The group size the patch declares for this module, checked to divide the weight's width."""
    cls = type(module).__name__
    if patch.group_size is not None:
        size = patch.group_size
    elif patch.group_size_attr is not None:
        size = _int_attr(module, patch.group_size_attr, "group_size_attr")
    elif patch.num_groups_attr is not None:
        groups = _int_attr(module, patch.num_groups_attr, "num_groups_attr")
        if groups <= 0 or width % groups:
            raise SignatureMismatch(f"{cls}.{patch.num_groups_attr} = {groups} does not divide the width {width}")
        size = width // groups
    else:
        return None
    if size <= 0 or width % size:
        raise SignatureMismatch(f"{cls}: group size {size} does not divide the width {width} of its weight")
    return size


def _int_attr(module: nn.Module, name: str, setting: str) -> int:
    value = getattr(module, name, None)
    if not isinstance(value, int) or isinstance(value, bool):
        raise SignatureMismatch(f"{type(module).__name__} has no integer attribute {name!r} ({setting})")
    return value


@register_op
class GatedRmsNormOp(ModuleOp):
    """Replace a gated RMSNorm's ``forward(hidden_states, gate)`` with ``kernel(x, gate, weight, eps)``."""

    name = "gated_rms_norm"
    patch_type = GatedRmsNormPatch
    declared_settings = ("scale", "activation", "order", "cast", "eps_attr")

    def reference(self, patch: GatedRmsNormPatch) -> Callable[..., Any]:
        return _build_torch(patch)

    def check_target(self, module: nn.Module, patch: GatedRmsNormPatch) -> None:
        cls = type(module)
        params = forward_parameters(cls)
        names = [p.name for p in params]
        if GATE_PARAM not in names:
            raise SignatureMismatch(
                f"gated_rms_norm cannot replace {describe_signature(cls)}: {cls.__name__}.forward has no "
                f"{GATE_PARAM!r} parameter, so the gate would be silently dropped. "
                "Use op: rms_norm for an ungated norm, or target the gated class."
            )
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        others = [p for p in params if p.name != GATE_PARAM]
        required = [p for p in others if p.default is inspect.Parameter.empty and p.kind in positional]
        if len(required) != 1 or names.index(GATE_PARAM) != 1:
            raise SignatureMismatch(
                f"gated_rms_norm cannot replace {describe_signature(cls)}: it expects "
                f"forward(hidden_states, {GATE_PARAM}), one tensor then the gate"
            )
        declared = getattr(module, "activation", None)
        if isinstance(declared, str) and declared in Activation.__members__ and declared != patch.activation.value:
            raise SignatureMismatch(
                f"{cls.__name__} declares activation {patch.activation.value!r}, but the module's own "
                f"`activation` attribute is {declared!r}; declare activation: {declared}"
            )
        before = getattr(module, "norm_before_gate", None)  # falcon_h1 keeps its order in the instance
        if isinstance(before, bool) and before != (patch.order is GateOrder.norm_then_gate):
            actual = GateOrder.norm_then_gate if before else GateOrder.gate_then_norm
            raise SignatureMismatch(
                f"{cls.__name__} declares order {patch.order.value!r}, but the module's own "
                f"`norm_before_gate` is {before}; declare order: {actual.value}"
            )
        weight = require_norm_attributes(module, patch.eps_attr, patch.weight_attr)
        _group_size(module, patch, weight.shape[-1])

    def bind(self, module: nn.Module, patch: GatedRmsNormPatch, impl: Callable[..., Any]) -> Callable[..., Any]:
        # eps, the weight and a group size held in an attribute are read on every call (never
        # captured), so changing them on the module after apply changes the patched forward too.
        eps_attr, weight_attr = patch.eps_attr, patch.weight_attr
        missing = gate_missing_message(type(module).__name__)  # once, not on the hot path
        required = patch.gate_required
        if patch.group_size_attr is None and patch.num_groups_attr is None:
            fixed = _group_size(module, patch, getattr(module, weight_attr).shape[-1])  # a constant of the patch

            def forward(self: nn.Module, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
                if gate is None and required:
                    raise ValueError(missing)
                return impl(hidden_states, gate, getattr(self, weight_attr), getattr(self, eps_attr), fixed)

        else:

            def forward(self: nn.Module, hidden_states: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
                if gate is None and required:
                    raise ValueError(missing)
                weight = getattr(self, weight_attr)
                group_size = _group_size(self, patch, weight.shape[-1])
                return impl(hidden_states, gate, weight, getattr(self, eps_attr), group_size)

        return forward

    def alternatives(self, patch: GatedRmsNormPatch) -> Iterator[tuple[str, GatedRmsNormPatch]]:
        declared = (patch.activation, patch.order, patch.scale, patch.cast)
        keys = ("activation", "order", "scale", "cast")
        for combo in itertools.product(Activation, GateOrder, Scale, CastOrder):
            if combo == declared:
                continue
            update = dict(zip(keys, combo, strict=True))
            label = ", ".join(f"{k}: {v.value}" for k, v, d in zip(keys, combo, declared, strict=True) if v != d)
            yield label, patch.model_copy(update={**update, "precision": Precision.native})

    def module_alternatives(self, patch: GatedRmsNormPatch, module: nn.Module) -> Iterator[tuple[str, GatedRmsNormPatch]]:
        """Also the declared norm per group of each int attribute that splits the width (a release that grouped it).

        Why: transformers 5.23 made Mamba 2's gated norm normalize per group of ``group_size``
        features; the ungrouped declaration then fails, and this names the one that fits.
        """
        yield from self.alternatives(patch)
        if patch.group_size is not None or patch.group_size_attr is not None or patch.num_groups_attr is not None:
            return
        weight = getattr(module, patch.weight_attr, None)
        if isinstance(weight, torch.Tensor) and weight.dim() >= 1:
            for group in _group_options(module, weight.shape[-1]):
                label = ", ".join(f"{k}: {v}" for k, v in group.items())
                yield label, patch.model_copy(update={**group, "precision": Precision.native})

    def candidates(self, module: nn.Module) -> Iterator[GatedRmsNormPatch]:
        """Every declaration a norm with a ``gate`` parameter could have (groups from its int attributes).

        ``gate_required`` is not a numeric question: it is read off the module by calling
        its own forward without a gate (an error means the gate is required).
        """
        if GATE_PARAM not in {p.name for p in forward_parameters(type(module))}:
            return
        weights, eps_attrs = norm_parameter_names(module)
        if not weights or not eps_attrs:
            return
        required = _gate_required(module, getattr(module, weights[0]))
        groups: list[dict[str, Any]] = [{}, *_group_options(module, getattr(module, weights[0]).shape[-1])]
        target = type(module).__name__
        for weight_attr, eps_attr, group, combo in itertools.product(
            weights, eps_attrs, groups, itertools.product(Scale, Activation, GateOrder, CastOrder)
        ):
            scale, activation, order, cast = combo
            yield GatedRmsNormPatch(
                op="gated_rms_norm", target=target, scale=scale, activation=activation, order=order, cast=cast,
                eps_attr=eps_attr, weight_attr=weight_attr, gate_required=required, **group,
            )


def _gate_required(module: nn.Module, weight: torch.Tensor) -> bool:
    """Whether the module's own forward refuses (raises on) a call without a gate.

    Ones, not random numbers: whether it raises does not depend on the values, and a draw from the global
    generator would move the caller's random state (the scaffold and the audit read this off live models).
    """
    x = torch.ones(2, weight.shape[-1], dtype=weight.dtype, device=weight.device)
    try:
        with torch.no_grad():
            type(module).forward(module, x, None)
    except Exception:  # noqa: BLE001  (any failure: the forward cannot run without its gate)
        return True
    return False


def _group_options(module: nn.Module, width: int) -> Iterator[dict[str, Any]]:
    """Group settings from the module's int attributes that split the width into several groups.

    A size equal to the width is the ungrouped norm (not a different declaration), so it is skipped.
    """
    for key, value in vars(module).items():
        if key.startswith("_") or not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            continue
        if value < width and width % value == 0:
            yield {"group_size_attr": key}
        if 1 < value < width and width % value == 0:
            yield {"num_groups_attr": key}
