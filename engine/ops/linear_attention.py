"""Linear attention by a delta rule: Qwen3-Next / Qwen3.5(-MoE) GatedDeltaNet, Kimi Linear KDA.

The layer's forward calls two module-level functions by global name (reference file,
section 7): ``torch_chunk_gated_delta_rule`` for training and prefill, and
``torch_recurrent_gated_delta_rule`` for cached decode (Kimi Linear:
``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention``). All take fla's API::

    f(query, key, value, g, beta, [chunk_size,] initial_state=None, output_final_state=False,
      use_qk_l2norm_in_kernel=False, **kwargs) -> (out [B, S, Hv, Dv], final_state | None)

The op's ground truth is transformers' own torch implementation, from one module per rule
(:data:`REFERENCES`; qwen3_next / qwen3_5 / qwen3_5_moe hold identical bodies, a test pins that). With
flash-linear-attention installed, the module attribute is a wrapper bound to fla on every
device; the reference always uses the torch function behind it (``__wrapped__``), so the
``torch`` kernel runs on CPU whatever is installed.

The torch path cannot keep packed sequences apart (``cu_seqlens``); like transformers'
wrapper, it refuses them with a ``ValueError`` instead of mixing sequences silently.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from engine.errors import InvalidArgument, SignatureMismatch
from engine.ops.base import FunctionOp, register_op
from engine.runtime.hub_functions import torch_body
from engine.schema import DeltaRule, DeltaRuleForm, LinearAttentionPatch

__all__ = ["REFERENCES", "LinearAttentionOp", "torch_reference"]

#: Where the op's ground truth lives: transformers' torch functions, per (rule, form).
REFERENCES: dict[tuple[DeltaRule, DeltaRuleForm], tuple[str, str]] = {
    (DeltaRule.gated_delta_rule, DeltaRuleForm.chunk):
        ("transformers.models.qwen3_next.modeling_qwen3_next", "torch_chunk_gated_delta_rule"),
    (DeltaRule.gated_delta_rule, DeltaRuleForm.recurrent):
        ("transformers.models.qwen3_next.modeling_qwen3_next", "torch_recurrent_gated_delta_rule"),
    (DeltaRule.kimi_delta_attention, DeltaRuleForm.chunk):
        ("transformers.models.kimi_linear.modeling_kimi_linear", "chunk_kimi_delta_attention"),
    (DeltaRule.kimi_delta_attention, DeltaRuleForm.recurrent):
        ("transformers.models.kimi_linear.modeling_kimi_linear", "recurrent_kimi_delta_attention"),
}
_LEADING = ("query", "key", "value", "g", "beta")
_STATE = ("initial_state", "output_final_state", "use_qk_l2norm_in_kernel")


def torch_reference(rule: DeltaRule, form: DeltaRuleForm) -> Callable[..., Any]:
    """transformers' torch function for ``(rule, form)`` (never the fla-bound wrapper)."""
    module_name, name = REFERENCES[(rule, form)]
    return torch_body(getattr(importlib.import_module(module_name), name))


def _build_torch(patch: LinearAttentionPatch) -> Callable[..., Any]:
    body = torch_reference(patch.rule, patch.form)

    @functools.wraps(body)
    def gated_delta_rule(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("cu_seqlens") is not None or kwargs.get("seq_idx") is not None:
            raise InvalidArgument(  # ours, and a ValueError as before
                "the torch gated delta rule cannot keep packed sequences (cu_seqlens) apart; "
                'use the fla kernel on cuda or npu (pip install "patch-engine[fla]")'
            )
        return body(*args, **kwargs)

    return gated_delta_rule


@register_op
class LinearAttentionOp(FunctionOp):
    """Replace a gated-delta-rule function of a modeling module (one patch per form)."""

    name = "linear_attention"
    patch_type = LinearAttentionPatch
    declared_settings = ("rule", "form")

    reference_description = "transformers' torch gated delta rule (the ground truth), every device"

    def reference(self, patch: LinearAttentionPatch) -> Callable[..., Any]:
        return _build_torch(patch)

    def check_function(self, function: Callable[..., Any], patch: LinearAttentionPatch) -> None:
        params = list(inspect.signature(torch_body(function)).parameters)
        where = f"{patch.function}({', '.join(params)})"
        if tuple(params[: len(_LEADING)]) != _LEADING or not set(_STATE) <= set(params):
            raise SignatureMismatch(
                f"linear_attention cannot replace {where}: expected "
                f"({', '.join(_LEADING)}, ..., {', '.join(_STATE)}), the gated delta rule of fla's API"
            )
        is_chunk = "chunk_size" in params
        if is_chunk != (patch.form is DeltaRuleForm.chunk):
            fits = "chunk" if is_chunk else "recurrent"
            raise SignatureMismatch(
                f"linear_attention with form: {patch.form.value} cannot replace {where}: "
                f"it {'takes' if is_chunk else 'has no'} chunk_size, so form: {fits} fits"
            )

    def candidates(self, name: str, function: Callable[..., Any]) -> Iterator[LinearAttentionPatch]:
        """Every (rule, form) the function's signature admits; the numbers decide the rule."""
        for rule, form in itertools.product(DeltaRule, DeltaRuleForm):
            patch = LinearAttentionPatch(op="linear_attention", function=name, rule=rule, form=form)
            if self.accepts(name, function, patch):
                yield patch
