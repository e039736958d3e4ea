"""Gradients taken or judged as autograd accumulates them, and checkpointing set aside for the truth run.

Why a module of its own: these hooks are how the whole-model checks keep one set of gradients at
a time (the original's moved out as they arrive, the patched one's compared and dropped), a
mechanism apart from what the checks compare.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from engine.verification.compare import compare
from engine.verification.verdicts import Grads

__all__ = ["hold", "unjudged"]

#: How many :func:`unjudged` blocks are open: while any is, the verification's gradient hooks do nothing.
_UNJUDGED = [0]


@contextlib.contextmanager
def unjudged() -> Iterator[None]:
    """A backward whose gradients no check takes: a condition's earlier training step (``optimizer step``).

    Why: the step's gradients land in ``.grad`` (where the hooks a model or a patch registered see them, and the
    step reads them), while the checks' hooks wait for the judged call's backward after it.
    """
    _UNJUDGED[0] += 1
    try:
        yield
    finally:
        _UNJUDGED[0] -= 1


def hold(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` detached, on ``device`` (no copy where it already is)."""
    return t.detach().to(device)


@contextlib.contextmanager
def _taking_gradients(model: nn.Module, into: dict[str, torch.Tensor], held: torch.device) -> Iterator[None]:
    """Each gradient of the run, moved out of ``.grad`` into ``into`` (on ``held``) as soon as autograd has accumulated it.

    Why as it arrives, not after the backward: on an accelerator with the gradients held on the
    host, the device then never holds more than the gradients autograd is still forming.
    """

    def take(p: torch.Tensor, name: str) -> None:
        if p.grad is not None:
            into[name] = hold(p.grad, held)
            p.grad = None

    with _on_gradient(dict(model.named_parameters()), take):
        yield


@contextlib.contextmanager
def _judge_gradients(params: dict[str, nn.Parameter], grads: Grads) -> Iterator[None]:
    """Compare each patched gradient with the original's when autograd has accumulated it, then drop it."""

    def hook(p: torch.Tensor, name: str) -> None:
        mine, theirs = p.grad, grads.original.get(name)
        p.grad = None
        if mine is None:
            return
        if theirs is None:
            grads.missing[name] = "no gradient in the original model"
            return
        grads.diff[name] = compare(mine, theirs)

    with _on_gradient(params, hook):
        yield


@contextlib.contextmanager
def _on_gradient(params: dict[str, nn.Parameter], fn: Callable[[torch.Tensor, str], None]) -> Iterator[None]:
    """``fn(param, name)`` each time autograd has accumulated a gradient of ``params``, while the block runs."""
    handles = [p.register_post_accumulate_grad_hook(lambda p, name=name: None if _UNJUDGED[0] else fn(p, name))
               for name, p in params.items() if p.requires_grad]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _no_checkpointing(model: nn.Module) -> Iterator[None]:
    """transformers' gradient checkpointing off for the truth run, restored after.

    Why: a checkpointed layer recomputes its forward during backward, outside the fp64 mode, so
    the recomputation would meet fp64 activations with fp32 weights. Checkpointing changes memory,
    not values, so the truth is the same without it.
    """
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in layers:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in layers:
            m.gradient_checkpointing = True
