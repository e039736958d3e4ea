"""Fused linear cross-entropy: the causal-LM loss from hidden states, never materializing all logits.

transformers computes ``logits = lm_head(h)`` for every token (``[tokens, vocab]``; 151936
columns for Qwen3), then ``ForCausalLMLoss``. This op replaces the head + loss of a
``*ForCausalLM`` / ``*ForConditionalGeneration`` forward with a kernel that computes the
same loss chunk by chunk (see :mod:`engine.ops.flce_torch`), for any family whose forward
follows transformers' template (read from its code by :mod:`engine.ops.causal_lm_head`).

The patched forward keeps transformers' contract:

* its signature is the original's (``inspect.signature(model.forward)`` is equal), so
  ``Trainer``'s ``remove_unused_columns`` and ``generate``'s ``logits_to_keep`` detection
  see what they see on the unpatched model;
* it fuses only in training with ``labels`` and ``logits_to_keep=0``; every other call
  (no labels, ``shift_labels`` alone, eval mode, generation, ``logits_to_keep`` with labels)
  *is* the original forward, with its outputs and its errors;
* when it fuses, the original forward itself runs with ``labels=None`` and an empty
  ``logits_to_keep`` (so it computes everything but the logits: hidden states, caches, the
  MoE router loss), the backbone's last hidden state is taken on the way, and the loss is
  the kernel's, plus ``coef * aux_loss`` where the forward adds it; ``logits`` is ``None``,
  also in the tuple of ``return_dict=False`` (kept in its position, as Liger does);
* Gemma's final-logit soft-cap and a LoRA on ``lm_head`` (folded into one weight, so the
  adapter trains) are part of the kernel's input; what cannot be reproduced is refused.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import SignatureMismatch
from engine.ops.base import ModuleOp, describe_signature, forward_parameters, register_op
from engine.ops.causal_lm_head import HeadContract, head_weight, read_head_contract
from engine.ops.flce_torch import chunked_linear_cross_entropy, linear_cross_entropy_reference
from engine.ops.sharded_head import (
    call_as_forward,
    defers_gradients,
    gradients_in_backward,
    is_sharded_head,
    zero_row_call_skipped,
)
from engine.ops.tied_gradient import deposit, tied_embedding_gradient
from engine.ops.trl_head import check_not_replaced, refuse_trl_bypass, refuse_trl_caller
from engine.ops.zero3 import peek
from engine.schema import FusedLinearCrossEntropyPatch

__all__ = ["FusedLinearCrossEntropyOp", "chunked_linear_cross_entropy", "linear_cross_entropy_reference"]


def _backbone_name(module: nn.Module, patch: FusedLinearCrossEntropyPatch) -> str:
    """The declared backbone, else ``base_model_prefix`` where it names a submodule, else ``model``.

    Why the fallback: some heads inherit a prefix that is not their attribute (Llama 4's
    ``Llama4ForCausalLM`` says ``language_model`` and holds ``model``).
    """
    if patch.backbone:
        return patch.backbone
    prefix = getattr(module, "base_model_prefix", "")
    if prefix and isinstance(getattr(module, prefix, None), nn.Module):
        return prefix
    return "model" if isinstance(getattr(module, "model", None), nn.Module) else prefix or "model"


@register_op
class FusedLinearCrossEntropyOp(ModuleOp):
    """Replace a causal-LM forward: in training with labels, the loss without full logits."""

    name = "fused_linear_cross_entropy"
    patch_type = FusedLinearCrossEntropyPatch
    opt_in = True  # training returns no logits: a scaffold reports where it fits, never adds it

    def candidates(self, module: nn.Module) -> Iterator[FusedLinearCrossEntropyPatch]:
        if "labels" in {p.name for p in forward_parameters(type(module))}:
            yield FusedLinearCrossEntropyPatch(op=self.name, target=type(module).__name__)

    reference_description = "torch, chunked over tokens with per-chunk gradients, every device"

    def reference(self, patch: FusedLinearCrossEntropyPatch) -> Callable[..., Any]:
        """The torch kernel: chunked, exact in fp32 against :func:`linear_cross_entropy_reference`."""
        return chunked_linear_cross_entropy

    def check_target(self, module: nn.Module, patch: FusedLinearCrossEntropyPatch) -> None:
        cls = type(module).__name__
        names = {p.name for p in forward_parameters(type(module))}
        if "labels" not in names:
            raise SignatureMismatch(
                f"fused_linear_cross_entropy cannot replace {describe_signature(type(module))}: it takes no "
                "`labels`; it replaces the head + loss of the *ForCausalLM / *ForConditionalGeneration model"
            )
        read_head_contract(type(module), patch.lm_head)
        check_not_replaced(module)  # TRL's trainer replaced the forward: the fused head would never run
        backbone = _backbone_name(module, patch)
        if not isinstance(getattr(module, backbone, None), nn.Module):
            raise SignatureMismatch(
                f"fused_linear_cross_entropy cannot find the backbone of {cls}: no submodule {backbone!r}; "
                "declare it with `backbone:` on the patch"
            )
        head_weight(getattr(module, patch.lm_head, None), f"{cls}.{patch.lm_head}")
        from transformers.loss.loss_utils import ForCausalLMLoss

        loss_fn = getattr(module, "loss_function", None)
        if loss_fn is not ForCausalLMLoss:
            raise SignatureMismatch(
                f"{cls}.loss_function is {getattr(loss_fn, '__name__', loss_fn)!r}, not ForCausalLMLoss; "
                "fused_linear_cross_entropy computes the causal-LM cross-entropy only"
            )

    def pre_hooks(self, module: nn.Module, patch: FusedLinearCrossEntropyPatch) -> list[tuple[str, Callable[..., Any]]]:
        """A guard on the backbone: a trainer calling it around the patched forward (TRL's head) is refused."""
        return [(_backbone_name(module, patch), refuse_trl_bypass)]

    def kernel_settings(self, module: nn.Module, patch: FusedLinearCrossEntropyPatch) -> Any:
        """The patch plus the head contract read from the forward (a provider may not do Granite's division)."""
        return FusedHeadSettings(patch, read_head_contract(type(module), patch.lm_head))

    def bind(
        self, module: nn.Module, patch: FusedLinearCrossEntropyPatch, impl: Callable[..., Any]
    ) -> Callable[..., Any]:
        original = type(module).forward
        signature = inspect.signature(original)  # through can_return_tuple & co, ``self`` first
        contract = read_head_contract(type(module), patch.lm_head)
        backbone = _backbone_name(module, patch)
        varkw = next((n for n, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD), None)

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            try:
                arguments = signature.bind(self, *args, **kwargs).arguments
            except TypeError:  # the original raises its own error for these arguments
                return original(self, *args, **kwargs)
            keep = arguments.get("logits_to_keep", 0)
            if arguments.get("labels") is None or not self.training or not (isinstance(keep, int) and keep == 0):
                return original(self, *args, **kwargs)
            return _fused_forward(self, original, dict(arguments), varkw, backbone, patch, contract, impl)

        forward.__signature__ = signature  # type: ignore[attr-defined]  (MethodType drops ``self``)
        forward.__doc__ = original.__doc__
        forward.__name__ = "forward"
        forward.__qualname__ = f"{type(module).__qualname__}.forward"
        return forward


@dataclass(frozen=True)
class FusedHeadSettings:
    """What a provider's ``supports`` sees: the patch's settings and the steps read from the forward."""

    patch: FusedLinearCrossEntropyPatch
    contract: HeadContract

    def __getattr__(self, name: str) -> Any:  # only for names not defined here: the patch's settings
        if name.startswith("__") or name in ("patch", "contract"):
            raise AttributeError(name)
        return getattr(self.patch, name)


def _fused_forward(
    model: nn.Module, original: Callable[..., Any], arguments: dict[str, Any], varkw: str | None, backbone: str,
    patch: FusedLinearCrossEntropyPatch, contract: HeadContract, impl: Callable[..., Any],
) -> Any:
    """The original forward without its logits, and the loss from the fused kernel."""
    refuse_trl_caller(model)  # a TRL trainer reads the logits this returns as None: refuse before computing
    arguments.pop("self", None)
    extra: dict[str, Any] = dict(arguments.pop(varkw, {}) if varkw else {})
    config = getattr(model, "config", None)
    return_dict = extra.pop("return_dict", None)
    if return_dict is None:
        return_dict = getattr(config, "return_dict", True)
    labels = arguments["labels"]
    call = {**arguments, **extra, "labels": None, "return_dict": True}
    head = model.get_submodule(patch.lm_head)
    raw_weight = peek(head, "weight")  # not gathered by ZeRO-3 before the backbone runs
    head_device = raw_weight.device
    call["logits_to_keep"] = torch.empty(0, dtype=torch.long, device=head_device)  # no logits computed at all
    captured: list[Any] = []
    handle = model.get_submodule(backbone).register_forward_hook(lambda m, i, o: captured.append(o))
    try:  # a tied input embedding adds its gradient into the head's: one [V, H] buffer, not two
        with tied_embedding_gradient(model, raw_weight) as mailbox, \
                zero_row_call_skipped(model, patch.lm_head, head, raw_weight):
            out = original(model, **call)
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError(f"{type(model).__name__}.{backbone} was not called by the forward; cannot fuse the head")
    last = captured[-1]
    hidden = last.last_hidden_state if hasattr(last, "last_hidden_state") else last[0]
    ignore_index = extra.get("ignore_index", -100)
    shift_labels = extra.get("shift_labels")
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]

    deferred = defers_gradients(head)

    def head_loss(rows: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        weight = head_weight(head, f"{type(model).__name__}.{patch.lm_head}")  # whole here, also when sharded
        if mailbox is not None and mailbox.lookups and weight is raw_weight:
            weight = deposit(weight, mailbox)

        def loss_of(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            return impl(
                rows, weight, target, ignore_index=ignore_index, num_items_in_batch=extra.get("num_items_in_batch"),
                chunk_size=patch.chunk_size, softcap=contract.softcap(model), logit_divisor=contract.divisor(model),
            )

        return gradients_in_backward(loss_of, rows, weight) if deferred else loss_of(rows, weight)

    rows, target = hidden.reshape(-1, hidden.shape[-1]), shift_labels.reshape(-1).to(hidden.device)
    # A head sharded by ZeRO-3 or FSDP2 is gathered by its own hooks for the kernel only; an FSDP2
    # unit's gradient is formed in the backward, where the gathered weight is all it holds (engine.ops.sharded_head)
    loss = call_as_forward(head, head_loss, rows, target) if is_sharded_head(head) else head_loss(rows, target)
    aux = out.get("aux_loss")
    coef = contract.aux_coef(model)
    if coef is not None and aux is not None:  # exactly as the forward adds it when labels are given
        loss = loss + coef * aux.to(loss.device)
    fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
    if return_dict is False:  # positions as the unpatched tuple, logits None (as Liger's)
        return (loss, *(None if k == "logits" else v for k, v in out.items() if k != "loss"))
    return type(out)(loss=loss, **fields)
