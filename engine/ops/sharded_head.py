"""The fused head's kernel run as ``lm_head``'s own forward, where ZeRO-3 or FSDP2 shards the head.

Why: a sharded head is whole only while its module's forward (and, again, its backward) runs.
DeepSpeed ZeRO-3 gathers a module's parameters in its forward pre-hook, partitions them in its
forward hook, and wraps the module's outputs (inputs) in autograd functions whose backward
gathers them again before the module's backward (releases them after). FSDP2's ``fully_shard``
does the same with unshard / reshard and its pre- and post-backward hooks. The fused head never
calls ``lm_head``: it reads the weight and computes the loss (and, chunk by chunk, the weight's
gradient) itself. Read outside the head's forward, ZeRO-3 gathers the weight and registers it
with the root model, which then holds the whole head from its forward's start to the end of its
backward; FSDP2 hands a sharded ``DTensor`` where the head is its own unit.

So where the head is sharded, the kernel runs *as* the head's forward: :func:`call_as_forward`
installs it as the module's ``forward`` for one call, so the head's hooks gather it for the
kernel, release it after, and gather it again for the backward, where the gradient formed in the
forward (held in the kernel's autograd node, not in the parameter) reaches the whole parameter,
as ZeRO-3's gradient hooks and FSDP2's reduce-scatter expect. (``deepspeed.zero.GatheredParameters``
around the kernel gathers it for the forward only: the gradient then reaches a partitioned
parameter, which DeepSpeed's backward rejects.) Elsewhere (no sharding, or FSDP2 with the head in
the root's unit, unsharded for the root's whole forward) the kernel runs directly, as before:
the head's other hooks (a user's forward hook that expects logits, accelerate's offload hooks)
never see a loss.

The original forward, run for everything but the logits, still calls the head on zero rows. For an
FSDP2 unit that call is a whole unshard / reshard of ``[V, H]`` (an all-gather) for nothing, and where the
head shares its unit with another module (``fully_shard([model.lm_head, model.model.norm])``, which keeps
the head's gradient off the end of the unit's reduce-scatter list; docs/training.md) it completes the
unit's forward early, so the kernel's call would open a second pass that FSDP2 closes only at the root's
end, reducing the gradients before the norm's backward. :func:`zero_row_call_skipped` hands that call
an empty result instead, without the head's hooks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from engine.ops.zero3 import peek

__all__ = ["call_as_forward", "defers_gradients", "gradients_in_backward", "is_sharded_head", "zero_row_call_skipped"]

_MISSING = object()


def _zero3_partitioned(module: nn.Module) -> bool:
    """Whether a parameter of ``module`` or of its submodules (a LoRA's base layer) is a ZeRO-3 parameter."""
    for sub in module.modules():
        for name in sub.__dict__.get("_parameters", {}):
            if hasattr(peek(sub, name), "ds_id"):  # peek: the check itself must not gather
                return True
    return False


def _fsdp2_unit(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` itself (not only to a module around it)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return False
    return isinstance(module, FSDPModule)


def is_sharded_head(head: nn.Module) -> bool:
    """Whether ``head`` is whole only inside its own forward: partitioned by ZeRO-3, or an FSDP2 unit."""
    return _zero3_partitioned(head) or _fsdp2_unit(head)


def defers_gradients(head: nn.Module) -> bool:
    """Whether the fused kernel forms ``head``'s gradients in the backward (:func:`gradients_in_backward`): an FSDP2 unit.

    Why FSDP2 only: it keeps the unit's all-gather output through the rest of the root's forward,
    so a gradient formed in the forward is a third ``[V, H]`` buffer there (1,024 tokens per rank,
    untied, ``fully_shard([lm_head, norm])``: 2950 -> 2623 MiB per rank, unpatched 3461). ZeRO-3
    releases its gather earlier, and the deferred gradient measured higher there (2596 -> 2658 MiB
    with ``reduce_bucket_size`` 5e7) for one more pass over the logits: it keeps the forward's.
    """
    return _fsdp2_unit(head)


def call_as_forward(module: nn.Module, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` run as ``module``'s forward, through ``module.__call__`` and so through its hooks.

    The module's own ``forward`` (a class method, or an instance attribute an engine or
    accelerate installed) is back in place afterwards, also when ``function`` raises.
    """
    saved = module.__dict__.get("forward", _MISSING)
    module.forward = function  # type: ignore[method-assign]  (an instance attribute: nn.Module.__call__ reads it)
    try:
        return module(*args)
    finally:
        if saved is _MISSING:
            del module.__dict__["forward"]
        else:
            module.__dict__["forward"] = saved


class _ZeroRowHead(nn.Module):
    """Stands in for an FSDP2 head while the original forward runs: zero rows in, zero rows of logits out.

    A call with rows (a forward that ignores ``logits_to_keep``) goes to the real head, hooks and all.
    """

    def __init__(self, head: nn.Module, vocab: int) -> None:
        super().__init__()
        self._head = (head,)  # a tuple: not registered as a submodule (named_modules stays the model's)
        self.vocab = vocab

    def forward(self, rows: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if rows.dim() >= 2 and rows.shape[-2] == 0 and not args and not kwargs:
            return rows.new_zeros((*rows.shape[:-1], self.vocab))
        return self._head[0](rows, *args, **kwargs)


@contextmanager
def zero_row_call_skipped(model: nn.Module, path: str, head: nn.Module, weight: Any) -> Iterator[None]:
    """While the body runs, an FSDP2-unit head at ``path`` answers a zero-row call without its hooks.

    Elsewhere (no FSDP2 unit) nothing changes. The head is back in place afterwards, also on error.
    ``weight`` is the head's weight as stored (its first dimension is the vocabulary, a DTensor's
    global shape for FSDP2).
    """
    if not _fsdp2_unit(head) or weight is None or not path:
        yield
        return
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    modules = parent.__dict__["_modules"]
    modules[name] = _ZeroRowHead(head, int(weight.shape[0]))  # the dict itself: no __setattr__ side effects
    try:
        yield
    finally:
        modules[name] = head


class _GradientsInBackward(torch.autograd.Function):
    """The loss without gradients in the forward; the kernel run again with gradients in the backward."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, weight: torch.Tensor,  # type: ignore[override]
                loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        ctx.loss_of = loss_of
        ctx.save_for_backward(rows, weight)
        return loss_of(rows.detach(), weight.detach())  # nothing requires a gradient: the loss alone

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        rows, weight = ctx.saved_tensors
        need = ctx.needs_input_grad[:2]
        with torch.enable_grad():
            inputs = (rows.detach().requires_grad_(need[0]), weight.detach().requires_grad_(need[1]))
            loss = ctx.loss_of(*inputs)
            wanted = [t for t, n in zip(inputs, need, strict=True) if n]
            found = iter(torch.autograd.grad(loss, wanted, grad) if wanted else ())
        return (next(found) if need[0] else None, next(found) if need[1] else None, None)


def gradients_in_backward(
    loss_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], rows: torch.Tensor, weight: torch.Tensor,
) -> torch.Tensor:
    """``loss_of(rows, weight)`` whose gradients are formed in the backward, not in the forward.

    Why, for a sharded head: a fused kernel forms the head's ``[V, H]`` gradient in its forward
    (nothing of size ``[tokens, vocab]`` waits for the backward), which is free when the weight
    is whole anyway. Sharded, the forward is where ZeRO-3 and FSDP2 hold the most beside the
    gathered weight: FSDP2 keeps the unit's all-gather output until the root's forward ends (a
    second ``[V, H]``), so a gradient formed there is a third. Formed in the backward, the weight
    (gathered again for it) and its gradient are all the head holds (:func:`defers_gradients`
    says where; ``benchmarks/results/sharded_head_cpu.md``), for one more pass over the head's
    logits (the loss is computed twice). Any provider's kernel: the loss and the gradients are
    its own, recomputed on the same inputs (bit-equal).
    """
    return _GradientsInBackward.apply(rows, weight, loss_of)
