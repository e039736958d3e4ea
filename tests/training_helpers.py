"""Shared pieces of the training-stack tests: patchsets with chosen kernels, and test kernels.

The training tests pin the kernels to ``torch`` (the reference) unless a test registers its
own: what they test is the engine inside FSDP2, torch.compile, checkpointing, PEFT and the
Trainer, and a faster provider picked by ``auto`` (e.g. a ``compiled`` one) would only make
them slower and no more telling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from engine.kernels import registry
from engine.loader import load_patchset


def qwen3_patchset(**kernels: str) -> dict[str, Any]:
    """The bundled qwen3 patchset with every kernel ``torch`` except those named: ``rope="x"``."""
    ps = load_patchset("qwen3").model_dump(mode="json")
    for patch in ps["patches"]:
        patch["kernel"] = kernels.get(patch["op"], "torch")
    return ps


@contextmanager
def extra_kernel(name: str, op: str, fn: Callable[..., Any], *, compile_safe: bool = True) -> Iterator[None]:
    """Register a test-only provider for the duration of a block."""
    registry.register(registry.KernelProvider(
        name=name, op=op, devices=registry.ALL_DEVICES, build=lambda patch: fn, compile_safe=compile_safe,
        description="test kernel"))
    try:
        yield
    finally:
        registry.unregister(name, op)


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a, "different (or no) tensors"
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@contextmanager
def patched(*models: torch.nn.Module, patchset: Any, **options: Any) -> Iterator[list[Any]]:
    """Apply ``patchset`` to each model for a block and revert even on failure.

    Why: a model left patched keeps the process-wide rope router installed, which other
    test modules rightly assert is gone after their own reverts. ``options`` go to
    :func:`engine.apply` (``unverified="trust"`` for a kernel that is wrong on purpose: by
    default content of the test's own is verified first and such a kernel refused).
    """
    import engine

    try:
        yield [engine.apply(m, patchset, device="cpu", mode="training", **options) for m in models]
    finally:
        for m in models:
            engine.revert(m)
