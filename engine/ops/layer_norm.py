"""LayerNorm: ``(x - mean(x)) / sqrt(var(x) + eps) * w + b`` over the last dimension.

The norm of vision towers (SigLIP in PaliGemma and Gemma 3, CLIP in LLaVA, InternViT,
mllama's vision model, the Qwen2-VL / Qwen3-VL vision blocks), which use ``nn.LayerNorm``
itself (``target: LayerNorm``), and of Nemotron (``NemotronLayerNorm1P``: ``1 + w``).

The reference is ``F.layer_norm``, the function those forwards call, so it is bit-for-bit
theirs in every dtype. ``scale: one_plus_weight`` forms ``weight + 1`` in the weight's
dtype, as ``NemotronLayerNorm1P.forward`` does (unlike RMSNorm's ``1 + w``, which every
transformers class forms in fp32): the declaration follows the module, not a convention.

The kernel signature is ``impl(x, weight, bias, eps)`` with the module's own weight (the
kernel applies ``scale``) and ``bias`` possibly ``None``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import SignatureMismatch
from engine.ops.base import ModuleOp, register_op, require_norm_attributes, require_single_input
from engine.schema import LayerNormPatch, Scale

__all__ = ["LayerNormOp", "layer_norm_reference", "layer_norm_weight"]


def layer_norm_weight(weight: torch.Tensor, scale: Scale) -> torch.Tensor:
    """The factor the normalized input is multiplied by: ``w``, or ``w + 1`` in w's dtype (Nemotron)."""
    return weight + 1.0 if scale is Scale.one_plus_weight else weight


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, *, scale: Scale = Scale.weight
) -> torch.Tensor:
    """The ground truth of the ``layer_norm`` op: ``F.layer_norm`` over the last dimension."""
    return F.layer_norm(x, (x.shape[-1],), layer_norm_weight(weight, scale), bias, eps)


@register_op
class LayerNormOp(ModuleOp):
    """Replace a LayerNorm's forward with ``kernel(x, weight, bias, eps)``."""

    name = "layer_norm"
    patch_type = LayerNormPatch

    def reference(self, patch: LayerNormPatch) -> Callable[..., Any]:
        if patch.scale is Scale.weight:
            return layer_norm_reference
        return partial(layer_norm_reference, scale=patch.scale)

    def check_target(self, module: nn.Module, patch: LayerNormPatch) -> None:
        require_single_input(module, self.name, forbid=("gate",))
        weight = require_norm_attributes(module, patch.eps_attr, patch.weight_attr)
        cls = type(module).__name__
        shape = getattr(module, "normalized_shape", (weight.shape[-1],))
        if weight.dim() != 1 or tuple(shape) != (weight.shape[0],):
            raise SignatureMismatch(
                f"{cls} normalizes over {tuple(shape)}; layer_norm normalizes over the last dimension only"
            )
        bias = getattr(module, patch.bias_attr, None)
        if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != weight.shape):
            raise SignatureMismatch(
                f"{cls}.{patch.bias_attr} is neither None nor a tensor of the weight's shape "
                f"{tuple(weight.shape)} (bias_attr)"
            )

    def bind(self, module: nn.Module, patch: LayerNormPatch, impl: Callable[..., Any]) -> Callable[..., Any]:
        eps = float(getattr(module, patch.eps_attr))
        weight_attr, bias_attr = patch.weight_attr, patch.bias_attr

        def forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  (nn.LayerNorm's name)
            return impl(input, getattr(self, weight_attr), getattr(self, bias_attr, None), eps)

        return forward

    def alternatives(self, patch: LayerNormPatch) -> Iterator[tuple[str, LayerNormPatch]]:
        for scale in Scale:
            if scale is not patch.scale:
                yield f"scale: {scale.value}", patch.model_copy(update={"scale": scale})

    def candidates(self, module: nn.Module) -> Iterator[LayerNormPatch]:
        """Every (weight, eps attribute, scale) a LayerNorm-shaped module could be declared with."""
        weights = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 1 and n != "bias"]
        eps_attrs = [k for k, v in vars(module).items()
                     if isinstance(v, float) and not k.startswith("_") and 0 < v < 1e-2]
        target = type(module).__name__
        for weight_attr, eps_attr, scale in itertools.product(weights, eps_attrs, Scale):
            yield LayerNormPatch(op="layer_norm", target=target, scale=scale, eps_attr=eps_attr,
                                 weight_attr=weight_attr)
