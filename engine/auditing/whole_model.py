"""The whole-model checks of an audit: logits, loss and every parameter gradient, in the order an audit needs.

``engine.verify`` runs the original, then the patched model, then (only if needed) the fp64
truth, all after the patch: it can, because its own patches are scoped to one instance and
:func:`engine.patching.patcher.original_forwards` takes them out. A foreign patch cannot be taken
out that way, so here the original and its truth run first, before the patch exists
(:func:`measure_original`), and the patched copy is judged afterwards against what they left
(:func:`judge_patched`), by the same runs and the same rules (:mod:`engine.verification.models`,
:mod:`engine.verification.verdicts`). The truth always runs (it cannot wait to see whether it is
needed): the audit's price for an original nothing can contaminate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine.runtime.hub_functions import torch_path
from engine.verification.compare import DTYPE_NAMES, compare, floating_dtype
from engine.verification.models import (
    hold,
    judging_gradients,
    run,
    taking_gradients,
    truth_run,
    without_labels,
)
from engine.verification.results import Check
from engine.verification.routing import RoutingLog, judged_with_routing_pinned, routes
from engine.verification.verdicts import Grads, grads_check, loss_noise, value_check

__all__ = ["OriginalRun", "judge_patched", "measure_original"]


@dataclass
class OriginalRun:
    """What the original left for the judge: its outputs and gradients, and the fp64 truth's."""

    head: str
    dtype: str
    logits: torch.Tensor
    loss: torch.Tensor
    grads: Grads
    truth: dict[str, torch.Tensor] = field(default_factory=dict)
    rounded: list[str] = field(default_factory=list)
    #: the experts its routers chose (a model that routes): what a failed judgement pins the patched run to
    routing: RoutingLog | None = None


@contextlib.contextmanager
def _own_grads(*models: nn.Module) -> Iterator[None]:
    """The caller's ``.grad`` tensors set aside for the block and put back after it."""
    every = {id(p): p for m in models for p in m.parameters()}
    saved = {key: p.grad for key, p in every.items()}
    for p in every.values():
        p.grad = None
    try:
        yield
    finally:
        for key, p in every.items():
            p.grad = saved[key]


def measure_original(model: nn.Module, batch: dict[str, Any], held: torch.device,
                     during: contextlib.AbstractContextManager[Any] | None = None, scenario: Any = None) -> OriginalRun:
    """The original's run (``during`` it: the modules' recording) and its fp64 truth, on the unpatched model
    (under ``scenario``, a condition of use: :mod:`engine.verification.conditions`)."""
    grads = Grads()
    dtype = getattr(scenario, "compute_dtype", None) or floating_dtype(model.parameters())
    routing = RoutingLog(dtype) if routes(model) else None
    with _own_grads(model):
        with (torch_path(model), taking_gradients(model, grads.original, held), during or contextlib.nullcontext(),
              routing.recording() if routing is not None else contextlib.nullcontext()):
            out = run(model, batch, scenario=scenario)
        head = "logits" if "logits" in out else "last_hidden_state"
        original = OriginalRun(head, DTYPE_NAMES.get(out[head].dtype, str(out[head].dtype)), hold(out[head], held),
                               hold(out["loss"], held), grads, routing=routing)
        del out

        def keep(values: dict[str, Any]) -> None:  # clones: the truth's backward may write its gradient into them
            original.truth.update({k: v.detach().clone() for k, v in values.items()})

        with torch_path(model):
            original.rounded = truth_run(model, batch, head, grads, held, keep, keep=True, scenario=scenario)
    return original


def judge_patched(patched: nn.Module, batch: dict[str, Any], original: OriginalRun, held: torch.device,
                  scenario: Any = None) -> list[Check]:
    """Logits, loss and gradients of ``patched`` against the measured original, judged as ``verify`` judges them;
    where they fail in a model that routes, judged again with its experts chosen as the original chose them."""
    checks = _judge_patched(patched, batch, original, held, scenario=scenario)
    if all(c.passed for c in checks) or original.routing is None:
        return checks
    log = original.routing
    return judged_with_routing_pinned(checks, log, lambda: _judge_patched(patched, batch, original, held, log.pinning,
                                                                               scenario))


def _judge_patched(patched: nn.Module, batch: dict[str, Any], original: OriginalRun, held: torch.device,
                   during: Any = contextlib.nullcontext, scenario: Any = None) -> list[Check]:
    cls, head = type(patched).__name__, original.head
    params = dict(patched.named_parameters())
    grads = Grads(original=original.grads.original, noise=original.grads.noise)  # diff and missing are this patch's
    taken: dict[str, torch.Tensor] = {}

    def between(out: Any) -> None:
        if out.get(head) is not None:
            taken[head] = hold(out[head], held)

    with _own_grads(patched), judging_gradients(params, grads), during():
        out = run(patched, batch, between=between, scenario=scenario)
    what = head
    if head not in taken:  # a fused head + loss makes no logits in training: the generation path's
        taken[head] = hold(without_labels(patched, batch, scenario)[head], held)
        what = f"{head} (no labels)"
    loss = hold(out["loss"], held)
    del out
    for name in grads.original.keys() - grads.diff.keys():
        grads.missing.setdefault(name, "no gradient in the patched model")
    waiting = {head: (what, taken[head], original.logits), "loss": ("loss", loss, original.loss)}
    typical = loss_noise(waiting, head, original.truth, batch)
    checks = []
    for key, (label, got, want) in waiting.items():
        seen = (*compare(got, want)[:2], got.dtype == want.dtype and torch.equal(got, want))
        truth = original.truth.get(key) if not grads.missing else None
        checks.append(value_check(cls, label, original.dtype, got, want, truth, typical if key == "loss" else None,
                                  seen))
    if scenario is None or scenario.backward:
        checks.append(grads_check(cls, original.dtype, grads, params))
    if original.rounded:
        for check in checks:
            check.note += f" (the fp64 truth still rounded in {', '.join(original.rounded)})"
    return checks
