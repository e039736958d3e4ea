"""LayerNorm: ``(x - mean(x)) / sqrt(var(x) + eps) * w + b`` over the last dimension.

The norm of vision towers (SigLIP in PaliGemma and Gemma 3, CLIP in LLaVA, InternViT,
mllama's vision model, the Qwen2-VL / Qwen3-VL vision blocks), which use ``nn.LayerNorm``
itself (``target: LayerNorm``), of GPT-NeoX, Phi-1/2, StableLM and Falcon (``nn.LayerNorm``
too), and of three families with a class of their own:

* Nemotron (``NemotronLayerNorm1P``): ``scale: one_plus_weight`` forms ``weight + 1`` in the
  weight's dtype, as its forward does (unlike RMSNorm's ``1 + w``, which every transformers
  class forms in fp32): the declaration follows the module, not a convention.
* OLMo 1 (``OlmoLayerNorm``): no weight and no bias (``weight_attr: null``), the input upcast
  to fp32 and the result cast back (``precision: fp32``), and eps a literal in the forward
  (``eps: 1.0e-05``), since no attribute holds it.
* Cohere, Cohere 2 (``CohereLayerNorm``): ``form: centered``, the statistics written out
  (``x - mean``, the mean of its square, ``rsqrt``), the weight multiplied in fp32 and the
  result cast last, no bias; its q/k norms (``use_qk_norm``) hold one weight per head, shape
  ``(heads, head_dim)``, broadcast over the heads of the input (only the centered form takes one).

``form: functional`` is ``F.layer_norm``, the function those forwards call, so it is bit for
bit theirs in every dtype. The two forms differ in the last bits in fp32 (``F.layer_norm``
computes the variance in one pass), so the scaffold tells them apart.

The kernel signature is ``impl(x, weight, bias, eps)`` with the module's own weight (the
kernel applies ``scale``), ``weight`` and ``bias`` possibly ``None``.
"""

from __future__ import annotations

import inspect
import itertools
import re
import textwrap
from collections.abc import Callable, Iterator
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import SignatureMismatch
from engine.ops.base import ModuleOp, register_op, require_single_input
from engine.schema import LayerNormForm, LayerNormPatch, Precision, Scale

__all__ = ["LayerNormOp", "layer_norm_reference", "layer_norm_weight"]

#: A float literal small enough to be an eps, as a forward writes it (``eps=1e-5``).
_EPS_LITERAL = re.compile(r"(?<![\w.])(\d+(?:\.\d*)?[eE]-\d+|0\.0*[1-9]\d*)(?![\w.])")


def layer_norm_weight(weight: torch.Tensor | None, scale: Scale) -> torch.Tensor | None:
    """The factor the normalized input is multiplied by: ``w``, or ``w + 1`` in w's dtype (Nemotron)."""
    if weight is None:
        return None
    return weight + 1.0 if scale is Scale.one_plus_weight else weight


def layer_norm_reference(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    *,
    scale: Scale = Scale.weight,
    form: LayerNormForm = LayerNormForm.functional,
    precision: Precision = Precision.native,
) -> torch.Tensor:
    """The ground truth of the ``layer_norm`` op (see the module docstring for the forms)."""
    w = layer_norm_weight(weight, scale)
    if form is LayerNormForm.centered:
        xf = x.to(torch.float32)
        mean = xf.mean(-1, keepdim=True)
        variance = (xf - mean).pow(2).mean(-1, keepdim=True)
        y = (xf - mean) * torch.rsqrt(variance + eps)
        if w is not None:
            y = w.to(torch.float32) * y
        if bias is not None:
            y = y + bias.to(torch.float32)
        return y.to(x.dtype)
    if w is not None and w.dim() > 1:  # a per-head weight (an alternative named for Cohere's q/k norms)
        y = F.layer_norm(x.to(torch.float32), (x.shape[-1],), None, None, eps) * w.to(torch.float32)
        return (y + bias.to(torch.float32) if bias is not None else y).to(x.dtype)
    if precision is Precision.fp32:
        w32 = w.to(torch.float32) if w is not None else None
        b32 = bias.to(torch.float32) if bias is not None else None
        return F.layer_norm(x.to(torch.float32), (x.shape[-1],), w32, b32, eps).to(x.dtype)
    return F.layer_norm(x, (x.shape[-1],), w, bias, eps)


def _forward_source(module: nn.Module) -> str:
    """The forward's source ('' where it has none: a builtin, a class made at run time)."""
    try:
        return textwrap.dedent(inspect.getsource(inspect.unwrap(type(module).forward)))
    except (OSError, TypeError):
        return ""


def _upcasts(source: str) -> bool:
    """Whether a forward's code casts its input to fp32 before normalizing (OLMo 1, Cohere)."""
    return "float32" in source or ".float()" in source


def _eps_literals(source: str) -> list[float]:
    """The eps-sized float literals a forward's code writes (OLMo 1's ``eps=1e-5``), in order, once each."""
    body = source.split(":", 1)[-1]  # past the signature: its defaults are not what the body computes with
    values = (float(m) for m in _EPS_LITERAL.findall(body))
    return list(dict.fromkeys(v for v in values if 0 < v < 1e-2))


@register_op
class LayerNormOp(ModuleOp):
    """Replace a LayerNorm's forward with ``kernel(x, weight, bias, eps)``."""

    name = "layer_norm"
    patch_type = LayerNormPatch

    def reference(self, patch: LayerNormPatch) -> Callable[..., Any]:
        if (patch.scale, patch.form, patch.precision) == (Scale.weight, LayerNormForm.functional, Precision.native):
            return layer_norm_reference
        return partial(layer_norm_reference, scale=patch.scale, form=patch.form, precision=patch.precision)

    def check_target(self, module: nn.Module, patch: LayerNormPatch) -> None:
        require_single_input(module, self.name, forbid=("gate",))
        cls = type(module).__name__
        if patch.eps is None:
            eps = getattr(module, patch.eps_attr, None)
            if not isinstance(eps, (float, int)) or isinstance(eps, bool):
                numeric = ", ".join(k for k, v in vars(module).items() if isinstance(v, float) and not k.startswith("_"))
                literal = _eps_literals(_forward_source(module))
                hint = f"; its forward writes eps as a literal: declare eps: {literal[0]}" if literal else ""
                raise SignatureMismatch(
                    f"{cls} has no numeric attribute {patch.eps_attr!r} (eps_attr); numeric attributes it has: "
                    f"{numeric or 'none'}{hint}"
                )
        weight = self._weight(module, patch)
        bias = getattr(module, patch.bias_attr, None)
        shape = getattr(module, "normalized_shape", None)
        if weight is None:
            if bias is not None:
                raise SignatureMismatch(f"{cls} has a bias but no weight is declared (weight_attr: null)")
            if shape is not None and len(tuple(shape)) != 1:
                raise SignatureMismatch(f"{cls} normalizes over {tuple(shape)}; layer_norm normalizes over the last dimension only")
            return
        per_head = weight.dim() == 2 and patch.form is LayerNormForm.centered and shape is None
        if not per_head and (weight.dim() != 1 or tuple(shape or (weight.shape[0],)) != (weight.shape[0],)):
            raise SignatureMismatch(
                f"{cls} normalizes over {tuple(shape or weight.shape)}; layer_norm normalizes over the last dimension "
                "only (a per-head (heads, head_dim) weight with form: centered)"
            )
        if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != weight.shape):
            raise SignatureMismatch(
                f"{cls}.{patch.bias_attr} is neither None nor a tensor of the weight's shape "
                f"{tuple(weight.shape)} (bias_attr)"
            )

    @staticmethod
    def _weight(module: nn.Module, patch: LayerNormPatch) -> torch.Tensor | None:
        cls = type(module).__name__
        if patch.weight_attr is None:
            params = [n for n, p in module.named_parameters(recurse=False) if n != patch.bias_attr]
            if params:
                raise SignatureMismatch(
                    f"{cls} has parameters {', '.join(params)}, but weight_attr: null declares none; "
                    f"declare weight_attr: {params[0]}"
                )
            return None
        weight = getattr(module, patch.weight_attr, None)
        if not isinstance(weight, torch.Tensor):
            raise SignatureMismatch(f"{cls} has no tensor attribute {patch.weight_attr!r} (weight_attr)")
        return weight

    def kernel_settings(self, module: nn.Module, patch: LayerNormPatch) -> Any:
        """The patch, and whether the module's weight is per head (a vendor kernel takes a 1-d weight only)."""
        weight = getattr(module, patch.weight_attr, None) if patch.weight_attr else None
        per_head = isinstance(weight, torch.Tensor) and weight.dim() > 1
        return SimpleNamespace(**{k: getattr(patch, k) for k in type(patch).model_fields}, per_head=per_head)

    def bind(self, module: nn.Module, patch: LayerNormPatch, impl: Callable[..., Any]) -> Callable[..., Any]:
        eps = float(patch.eps if patch.eps is not None else getattr(module, patch.eps_attr))
        weight_attr, bias_attr = patch.weight_attr, patch.bias_attr
        if weight_attr is None:

            def bare(self: nn.Module, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  (nn.LayerNorm's name)
                return impl(input, None, None, eps)

            return bare

        def forward(self: nn.Module, input: torch.Tensor) -> torch.Tensor:  # noqa: A002  (nn.LayerNorm's name)
            return impl(input, getattr(self, weight_attr), getattr(self, bias_attr, None), eps)

        return forward

    def alternatives(self, patch: LayerNormPatch) -> Iterator[tuple[str, LayerNormPatch]]:
        if patch.weight_attr is not None:
            for scale in Scale:
                if scale is not patch.scale:
                    yield f"scale: {scale.value}", patch.model_copy(update={"scale": scale})
        for form in LayerNormForm:
            if form is not patch.form:
                yield f"form: {form.value}", patch.model_copy(update={"form": form})

    def candidates(self, module: nn.Module) -> Iterator[LayerNormPatch]:
        """Every (weight, eps, scale, form) a LayerNorm-shaped module could be declared with.

        eps: each float attribute, or (none holding one) each eps-sized literal of the forward's
        code. ``precision: fp32`` is offered exactly where the forward's code upcasts (OLMo 1): in
        the dtypes measured here ``F.layer_norm`` rounds once either way, so measuring could not
        tell the two apart, while the code says which one the module computes.
        """
        per_head = "Norm" in type(module).__name__  # a 2-d weight is a per-head norm's only in a norm class
        weights: list[str | None] = [
            n for n, p in module.named_parameters(recurse=False) if (p.dim() == 1 or p.dim() == 2 and per_head)
            and n != "bias"
        ]
        if not weights and next(module.parameters(recurse=False), None) is None:
            weights = [None]
        eps_attrs = [k for k, v in vars(module).items()
                     if isinstance(v, float) and not k.startswith("_") and 0 < v < 1e-2]
        source = _forward_source(module)
        eps_options: list[dict[str, Any]] = [{"eps_attr": k} for k in eps_attrs]
        if not eps_options:
            eps_options = [{"eps": v} for v in _eps_literals(source)]
        if weights == [None] and not ("layer_norm" in source or "Norm" in type(module).__name__):
            return  # a parameterless module (an activation, dropout) is no LayerNorm unless its code says so
        precision = Precision.fp32 if _upcasts(source) else Precision.native
        target = type(module).__name__
        for weight_attr, eps, form in itertools.product(weights, eps_options, LayerNormForm):
            if weight_attr is not None and form is LayerNormForm.functional and getattr(module, weight_attr).dim() != 1:
                continue  # a per-head weight: the centered form only
            scales = list(Scale) if weight_attr is not None else [Scale.weight]
            for scale in scales:
                yield LayerNormPatch(
                    op="layer_norm", target=target, scale=scale, weight_attr=weight_attr, form=form,
                    precision=Precision.native if form is LayerNormForm.centered else precision, **eps,
                )
