"""One ``[vocab, hidden]`` gradient for a tied head + embedding: the embedding adds into the head's.

Why: with tied embeddings (``lm_head.weight is embed_tokens.weight``) the weight gets two
gradients in one backward: the fused head's (a dense ``[V, H]`` tensor, computed chunk by
chunk) and the embedding's. ``nn.Embedding``'s backward makes a second dense ``[V, H]``
tensor (``embedding_dense_backward``: zeros, then the token rows added), and autograd sums
the two in its input buffer, so at that moment two full copies exist: 594 MiB extra for a
151,936 x 1024 fp32 head, 1.76x the gradient floor of issue 13's training step. (A sparse
embedding gradient does not help: autograd's input buffer adds a sparse gradient to a dense
one out of place, another ``[V, H]`` tensor.)

So, for the duration of one fused forward, the weight's two uses hand one buffer along:

* the embedding lookup with the tied weight runs as :class:`_TiedEmbedding`;
* the head's weight goes through :class:`_Deposit`, an identity whose backward puts the head's
  weight gradient in a shared :class:`Mailbox` instead of returning it;
* the embedding's backward (which autograd runs after the head's: its input depends on the
  head's hidden-state gradient) adds its token rows *into* that buffer
  (``index_put_(accumulate=True)``, deterministic where torch's determinism asks for it) and
  returns it as the weight's gradient: one edge, one dense tensor, adopted as ``.grad``.

The result is the same sum autograd forms, so hooks, ``.grad`` accumulation across steps,
``torch.autograd.grad`` and optimizers see what they see on the unpatched model. Whatever the
execution order, nothing is lost: if the embedding's backward ran first, it returns its own
gradient and closes the mailbox, and the head's gradient then goes to the weight as usual.

Used only where it is exact and plain: an ``F.embedding`` call on exactly the head's weight
(a plain parameter that requires grad, not a DTensor or another subclass) without
``max_norm``, ``scale_grad_by_freq`` or ``sparse``, with grad enabled, and not while
``torch.compile`` traces. Everywhere else the lookup is transformers' own.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from engine.ops.zero3 import peek

__all__ = ["Mailbox", "deposit", "tied_embedding_gradient"]

_EMBEDDING_SIGNATURE = inspect.signature(F.embedding)


class Mailbox:
    """Where the head's weight gradient waits for the embedding's backward, within one backward pass."""

    __slots__ = ("closed", "grad", "lookups")

    def __init__(self) -> None:
        self.grad: torch.Tensor | None = None
        self.closed = False  # an embedding backward found it empty: later deposits return to autograd
        self.lookups = 0  # embedding calls routed through it in this forward


class _Deposit(torch.autograd.Function):
    """Identity on the head's weight; backward leaves the gradient in the mailbox for the embedding."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, mailbox: Mailbox) -> torch.Tensor:  # type: ignore[override]
        ctx.mailbox = mailbox
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None]:  # type: ignore[override]
        mailbox: Mailbox = ctx.mailbox
        if mailbox.closed or grad is None:
            return grad, None
        if mailbox.grad is None:
            mailbox.grad = grad
        else:
            mailbox.grad.add_(grad)
        return None, None


class _TiedEmbedding(torch.autograd.Function):
    """``F.embedding(ids, weight, padding_idx)`` whose weight gradient is added into the mailbox's buffer."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None, mailbox: Mailbox
    ) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.mailbox, ctx.shape = padding_idx, mailbox, weight.shape
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (ids,) = ctx.saved_tensors
        mailbox: Mailbox = ctx.mailbox
        rows = grad_out.reshape(-1, grad_out.shape[-1])
        flat = ids.reshape(-1)
        if ctx.padding_idx is not None:  # as embedding_dense_backward: the padding row gets nothing
            keep = flat != ctx.padding_idx
            rows, flat = rows[keep], flat[keep]
        grad = mailbox.grad
        mailbox.grad = None  # the mailbox lets go: autograd holds the only reference and adopts it
        if grad is None:
            mailbox.closed = True
            grad = torch.zeros(ctx.shape, dtype=grad_out.dtype, device=grad_out.device)
        grad.index_put_((flat,), rows.to(grad.dtype), accumulate=True)
        return None, grad, None, None


def _plain_parameter(weight: Any) -> bool:
    return type(weight) in (torch.Tensor, nn.Parameter)


class _RouteTiedLookups(TorchFunctionMode):
    """Routes ``F.embedding`` on ``weight`` through :class:`_TiedEmbedding`; every other call is untouched."""

    def __init__(self, weight: torch.Tensor, mailbox: Mailbox) -> None:
        super().__init__()
        self.weight, self.mailbox = weight, mailbox

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is F.embedding:
            bound = _EMBEDDING_SIGNATURE.bind(*args, **kwargs)
            bound.apply_defaults()
            a = bound.arguments
            if (a["weight"] is self.weight and a["max_norm"] is None and not a["scale_grad_by_freq"]
                    and not a["sparse"] and not a["input"].is_floating_point()):
                self.mailbox.lookups += 1
                return _TiedEmbedding.apply(a["input"], a["weight"], a["padding_idx"], self.mailbox)
        return func(*args, **kwargs)


def _eligible(embedding: Any, head_weight: Any) -> bool:
    return (
        isinstance(embedding, nn.Embedding)
        and peek(embedding, "weight") is head_weight  # not gathered by ZeRO-3 just to compare
        and _plain_parameter(head_weight)
        and head_weight.requires_grad
        and head_weight.device.type != "meta"
        and torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    )


@contextmanager
def tied_embedding_gradient(model: nn.Module, head_weight: torch.Tensor) -> Iterator[Mailbox | None]:
    """Within the block, the input embedding's lookups on ``head_weight`` feed one shared gradient.

    Yields the :class:`Mailbox` (pass the head's weight through :func:`deposit` when its
    ``lookups`` is non-zero) or ``None`` where the embedding is not tied to ``head_weight``
    or the shared gradient does not apply (see the module docstring).
    """
    get = getattr(model, "get_input_embeddings", None)
    try:
        embedding = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        embedding = None
    if not _eligible(embedding, head_weight):
        yield None
        return
    mailbox = Mailbox()
    mode = _RouteTiedLookups(head_weight, mailbox)
    entered: list[bool] = []

    def enter(module: nn.Module, args: Any) -> None:  # only the embedding's own forward goes through the mode
        mode.__enter__()
        entered.append(True)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        if entered:
            entered.pop()
            mode.__exit__(None, None, None)

    handles = [embedding.register_forward_pre_hook(enter),
               embedding.register_forward_hook(leave, always_call=True)]
    try:
        yield mailbox
    finally:
        for handle in handles:
            handle.remove()
        while entered:  # a failed pre-hook chain: never leave the mode pushed
            entered.pop()
            mode.__exit__(None, None, None)


def deposit(weight: torch.Tensor, mailbox: Mailbox) -> torch.Tensor:
    """``weight`` as the head's input: its gradient goes to ``mailbox``, for the embedding to add into."""
    return _Deposit.apply(weight, mailbox)
