"""The ``fused_cross_entropy`` switch: one setting that fuses the head + loss of any causal LM.

Why a switch rather than a ``*_flce.yaml`` per family: the op's target is always the same
thing, the model's own ``*ForCausalLM`` / ``*ForConditionalGeneration`` class (the root
module, the one whose forward takes ``labels``), and what that forward does after its head
is read from its code at plan time (:mod:`engine.ops.causal_lm_head`). So the target is
found here, for any model type, and every patchset (bundled or not, and every family added
later) gets the fused head from ``fused_cross_entropy: true`` in YAML or
``engine.apply(model, "qwen3", fused_cross_entropy=True)``, the way Liger's
``apply_liger_kernel_to_X(fused_linear_cross_entropy=True)`` does.

Off by default: in training with labels the fused forward returns ``logits=None``, an
output change a caller that reads training logits (metrics, distillation, DPO-style losses:
LlamaFactory turns Liger's fused loss off for those stages) must opt into. An explicit
``op: fused_linear_cross_entropy`` patch in a patchset wins over the switch's defaults;
``fused_cross_entropy=False`` removes it.
"""

from __future__ import annotations

from typing import Any

from engine.schema import FusedCrossEntropy, FusedLinearCrossEntropyPatch, Patchset

__all__ = ["FusedSwitch", "applied_fused_head", "with_fused_cross_entropy", "without_fused_head"]

OP = "fused_linear_cross_entropy"

#: What ``fused_cross_entropy=`` accepts: on/off, settings, or ``None`` (the patchset's own key).
FusedSwitch = bool | FusedCrossEntropy | dict[str, Any] | None


def with_fused_cross_entropy(patchset: Patchset, model: Any, switch: FusedSwitch = None) -> Patchset:
    """``patchset`` with the fused head added for ``model``'s class (or removed), per ``switch``.

    Args:
        patchset: the loaded patchset.
        model: the (unwrapped) transformers model; its class is the target.
        switch: ``None`` keeps the patchset's ``fused_cross_entropy`` key; ``True`` / a
            mapping / :class:`FusedCrossEntropy` switches it on; ``False`` switches it off
            (dropping explicit ``fused_linear_cross_entropy`` patches too).
    """
    setting: bool | FusedCrossEntropy | dict[str, Any] = patchset.fused_cross_entropy if switch is None else switch
    if isinstance(setting, dict):
        setting = FusedCrossEntropy(**setting)
    explicit = [p for p in patchset.patches if p.op == OP]
    if setting is False:
        if not explicit or switch is None:
            return patchset
        kept = [p for p in patchset.patches if p.op != OP]
        return patchset.model_copy(update={"patches": kept, "fused_cross_entropy": False})
    if explicit:
        return patchset
    settings = setting if isinstance(setting, FusedCrossEntropy) else FusedCrossEntropy()
    patch = FusedLinearCrossEntropyPatch(
        op=OP, target=type(model).__name__, kernel=settings.kernel, chunk_size=settings.chunk_size
    )
    return patchset.model_copy(update={"patches": [*patchset.patches, patch], "fused_cross_entropy": setting})


def without_fused_head(patchset: Patchset) -> Patchset:
    """``patchset`` with the fused head removed: what identifies it when it is applied again.

    Why: the fused head is an option of a patchset (``fused_cross_entropy=``), not another
    patchset, so applying ``"qwen3"`` with the head switched on to a model patched with
    ``"qwen3"`` re-plans it instead of refusing it as a different patchset.
    """
    kept = [p for p in patchset.patches if p.op != OP]
    return patchset.model_copy(update={"patches": kept, "fused_cross_entropy": False})


def applied_fused_head(patchset: Patchset, decisions: Any) -> Patchset:
    """``patchset`` with exactly the fused head a model has now (``decisions`` of its report), or none.

    Why: re-applying with ``fused_cross_entropy=None`` (no opinion, e.g. ``PatchsetCallback``)
    keeps the head the model was patched with rather than the patchset file's default.
    """
    base = without_fused_head(patchset)
    heads = {d.patch_index: d.patch for d in decisions if d.op == OP}
    return base.model_copy(update={"patches": [*base.patches, *heads.values()]})
