"""Fused linear cross-entropy: the causal-LM loss from hidden states, never materializing all logits.

transformers computes ``logits = lm_head(h)`` for every token (``[tokens, vocab]``; 151936
columns for Qwen3), then ``ForCausalLMLoss``: ``logits.float()``, labels shifted left by one
(padded with ``ignore_index``), ``cross_entropy(..., reduction="mean")``, or ``"sum"`` divided
by ``num_items_in_batch`` when that is given. In training the logits, their fp32 copy, the
log-softmax and the logits' gradient are each alive at some point: gigabytes for a long
sequence.

This op computes the same loss chunk by chunk over tokens. Because the loss is the last node of
the graph, each chunk's gradient with respect to its hidden states and to the head weight is
computed in the forward (Liger-Kernel's trick), so nothing of size ``[tokens, vocab]`` is kept:
backward only scales the stored gradients by ``grad_output``. The head-weight gradient is
accumulated in fp32 across chunks.

Kernel signature: ``kernel(hidden [N, H], weight [V, H], target [N], *, ignore_index,
num_items_in_batch, chunk_size) -> loss`` (a 0-d fp32 tensor), where ``target`` is already shifted.

What the patched forward returns: without labels, or in eval mode, the model's own forward
runs (so generation and evaluation get their logits); with labels in training, ``logits`` is
``None`` (that is the point), everything else as the model returns it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import SignatureMismatch
from engine.ops.base import ModuleOp, describe_signature, forward_parameters, register_op
from engine.schema import FusedLinearCrossEntropyPatch

__all__ = [
    "CHUNK_BUDGET_BYTES",
    "FusedLinearCrossEntropyOp",
    "auto_chunk_size",
    "chunked_linear_cross_entropy",
    "linear_cross_entropy_reference",
]

#: The fp32 logits of one chunk stay under this many bytes when ``chunk_size`` is not given.
CHUNK_BUDGET_BYTES = 128 << 20


def auto_chunk_size(num_tokens: int, vocab: int) -> int:
    """Tokens per chunk so that one chunk's fp32 logits fit :data:`CHUNK_BUDGET_BYTES`."""
    return max(1, min(num_tokens, CHUNK_BUDGET_BYTES // (4 * vocab)))


def _denominator(target: torch.Tensor, ignore_index: int, num_items_in_batch: Any) -> float:
    """What transformers divides the summed loss by: the valid-token count, or num_items_in_batch."""
    if num_items_in_batch is None:
        return float((target != ignore_index).sum())
    return float(num_items_in_batch)


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    num_items_in_batch: Any = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The ground truth, materializing all logits exactly as transformers' ``ForCausalLMLoss`` does."""
    logits = F.linear(hidden, weight).float()
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
    return loss / num_items_in_batch if num_items_in_batch is not None else loss


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Loss and both gradients, chunk by chunk, in the forward; backward scales them."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
        ignore_index: int, denominator: float, chunk_size: int,
    ) -> torch.Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n = hidden.shape[0]
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        for start in range(0, n, chunk_size):
            h = hidden[start : start + chunk_size]
            t = target[start : start + chunk_size]
            valid = t != ignore_index
            safe_t = torch.where(valid, t, 0).unsqueeze(1)
            logits = F.linear(h, weight).float()  # as the model: head in its dtype, loss in fp32
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            token_loss = (lse - logits.gather(1, safe_t)).squeeze(1)
            loss_sum += token_loss.masked_fill(~valid, 0.0).sum()
            if need_h or need_w:
                grad = logits.sub_(lse).exp_()  # softmax, in place of the logits
                grad.scatter_add_(1, safe_t, torch.full_like(safe_t, -1, dtype=grad.dtype))
                grad.mul_((valid.to(grad.dtype) / denominator).unsqueeze(1))
                grad = grad.to(hidden.dtype)  # the model's logits.float() casts its gradient back
                if need_h:
                    grad_h[start : start + chunk_size] = grad @ weight  # type: ignore[index]
                if need_w and grad_w.dtype == h.dtype:  # type: ignore[union-attr]
                    grad_w.addmm_(grad.t(), h)  # type: ignore[union-attr]  (accumulates in place, no temporary)
                elif need_w:
                    grad_w.add_(grad.t() @ h)  # type: ignore[union-attr]
        # Kept as attributes, not saved tensors: backward drops the last reference before returning
        # them, so autograd adopts the buffers as .grad instead of copying a [vocab, hidden] tensor.
        ctx.grads = (grad_h, None if grad_w is None else grad_w.to(weight.dtype))
        return loss_sum / denominator

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        grads = ctx.__dict__.pop("grads", None)
        if grads is None:
            raise RuntimeError(
                "fused_linear_cross_entropy: backward runs once per forward (the gradients are computed in the "
                "forward and handed over); run the forward again instead of retain_graph=True"
            )
        grad_h, grad_w = grads
        if not bool(grad_output == 1):
            grad_h = None if grad_h is None else grad_h * grad_output.to(grad_h.dtype)
            grad_w = None if grad_w is None else grad_w * grad_output.to(grad_w.dtype)
        return grad_h, grad_w, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    num_items_in_batch: Any = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The ``torch`` provider: chunked over tokens, gradients computed per chunk, fp32 accumulation."""
    chunk = chunk_size or auto_chunk_size(hidden.shape[0], weight.shape[0])
    denominator = _denominator(target, ignore_index, num_items_in_batch)
    return _ChunkedLinearCrossEntropy.apply(hidden, weight, target, ignore_index, denominator, chunk)


_SOFTCAP_KEYS = ("final_logit_softcapping", "logit_softcapping", "output_logits_soft_cap")


@register_op
class FusedLinearCrossEntropyOp(ModuleOp):
    """Replace a ``*ForCausalLM`` forward: in training with labels, loss without full logits."""

    name = "fused_linear_cross_entropy"
    patch_type = FusedLinearCrossEntropyPatch
    opt_in = True  # training returns no logits: a scaffold reports where it fits, never adds it

    def candidates(self, module: nn.Module) -> Iterator[FusedLinearCrossEntropyPatch]:
        if "labels" in {p.name for p in forward_parameters(type(module))}:
            yield FusedLinearCrossEntropyPatch(op=self.name, target=type(module).__name__)

    reference_description = "torch, chunked over tokens with per-chunk gradients, every device"

    def reference(self, patch: FusedLinearCrossEntropyPatch) -> Callable[..., Any]:
        return chunked_linear_cross_entropy

    def check_target(self, module: nn.Module, patch: FusedLinearCrossEntropyPatch) -> None:
        cls = type(module).__name__
        names = {p.name for p in forward_parameters(type(module))}
        if "labels" not in names:
            raise SignatureMismatch(
                f"fused_linear_cross_entropy cannot replace {describe_signature(type(module))}: it takes no "
                "`labels`; target the *ForCausalLM class (the one that computes the loss)"
            )
        if not isinstance(getattr(module, patch.backbone, None), nn.Module):
            raise SignatureMismatch(f"{cls} has no submodule {patch.backbone!r} (backbone)")
        head = getattr(module, patch.lm_head, None)
        if not isinstance(head, nn.Linear):
            raise SignatureMismatch(f"{cls}.{patch.lm_head} is {type(head).__name__}, not an nn.Linear (lm_head)")
        if head.bias is not None:
            raise SignatureMismatch(f"{cls}.{patch.lm_head} has a bias; fused_linear_cross_entropy supports none")
        config = getattr(module, "config", None)
        for key in _SOFTCAP_KEYS:
            if getattr(config, key, None) is not None:
                raise SignatureMismatch(
                    f"{cls} soft-caps its logits ({key}={getattr(config, key)}), which "
                    "fused_linear_cross_entropy does not implement; remove this patch for this family"
                )
        from transformers.loss.loss_utils import ForCausalLMLoss

        loss_fn = getattr(module, "loss_function", None)
        if loss_fn is not ForCausalLMLoss:
            raise SignatureMismatch(
                f"{cls}.loss_function is {getattr(loss_fn, '__name__', loss_fn)!r}, not ForCausalLMLoss; "
                "fused_linear_cross_entropy computes the causal-LM cross-entropy only"
            )

    def bind(
        self, module: nn.Module, patch: FusedLinearCrossEntropyPatch, impl: Callable[..., Any]
    ) -> Callable[..., Any]:
        original = type(module).forward
        signature = inspect.signature(inspect.unwrap(original))
        params = list(signature.parameters)
        labels_pos = params.index("labels") - 1  # position among the arguments after self
        backbone, head, chunk_size = patch.backbone, patch.lm_head, patch.chunk_size

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            labels = args[labels_pos] if len(args) > labels_pos else kwargs.get("labels")
            if (labels is None and kwargs.get("shift_labels") is None) or not self.training:
                return original(self, *args, **kwargs)
            return _fused_forward(self, signature, backbone, head, impl, chunk_size, args, kwargs)

        return forward


def _fused_forward(
    model: nn.Module, signature: inspect.Signature, backbone: str, head: str, impl: Callable[..., Any],
    chunk_size: int | None, args: tuple[Any, ...], kwargs: dict[str, Any],
) -> Any:
    """What ``*ForCausalLM.forward`` does with labels, with head + loss fused and no logits returned."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    config = getattr(model, "config", None)
    return_dict = kwargs.pop("return_dict", getattr(config, "return_dict", True))
    bound = signature.bind(model, *args, **kwargs)
    arguments = dict(bound.arguments)
    arguments.pop("self", None)
    extra = arguments.pop(next(n for n, p in signature.parameters.items() if p.kind is p.VAR_KEYWORD), {})
    labels = arguments.pop("labels", None)
    logits_to_keep = arguments.pop("logits_to_keep", 0)
    outputs = model._modules[backbone](**arguments, **extra)
    hidden = outputs.last_hidden_state
    if not (isinstance(logits_to_keep, int) and logits_to_keep == 0):
        from transformers.modeling_utils import slice_logits_to_keep

        hidden = slice_logits_to_keep(hidden, logits_to_keep)
    ignore_index = extra.get("ignore_index", -100)
    shift_labels = extra.get("shift_labels")
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    weight = model._modules[head].weight
    loss = impl(
        hidden.reshape(-1, hidden.shape[-1]), weight, shift_labels.reshape(-1).to(hidden.device),
        ignore_index=ignore_index, num_items_in_batch=extra.get("num_items_in_batch"), chunk_size=chunk_size,
    )
    fields = {k: v for k, v in outputs.items() if k != "last_hidden_state"}
    output = CausalLMOutputWithPast(loss=loss, logits=None, **fields)
    return output if return_dict is not False else output.to_tuple()
