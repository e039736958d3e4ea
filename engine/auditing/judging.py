"""One changed module or function judged against the original's record: the numbers, then the explanation.

The patched module (or the function now bound in the modeling module) runs on the inputs the
original recorded, without a graph, with the same random draws; the result is compared with
the original's output on them by :func:`engine.verification.compare.judge` (bit-equal, or within
``k`` times the original's own error against its fp64 truth), the rule ``verify`` applies to a
kernel. Where it is not bit-equal, :mod:`engine.auditing.explain` names the declarations. A
patched forward that raises is ``unchecked`` with its error, never ``passes``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.auditing.changes import Change
from engine.auditing.explain import ROUNDING_KEYS, Explanation, explain_function, explain_module
from engine.auditing.recording import Recorded
from engine.auditing.report import Row
from engine.verification.compare import clone_tensors, compare, is_exact, judge, max_abs_diff, move_tensors, tensors_of
from engine.verification.random_state import same_draws

__all__ = ["judge_change"]


def judge_change(change: Change, rec: Recorded | None, patched: Any, original: Any, device: torch.device) -> Row:
    """The row of one change: ``patched`` is the patched module (or function), ``original`` the unpatched one."""
    row = Row(change.path, change.cls, change.kind, change.detail, "whole model")
    if change.judged == "none":
        row.result = "not in this model"
        return row
    if change.judged == "fact":  # requires_grad switched: training updates other weights than the original's
        row.result = "differs"
        row.note = ("training no longer updates it (no gradient reaches it)" if "-> False" in change.detail
                    else "training now updates a weight the original keeps frozen")
        return row
    if change.judged not in ("module", "function", "through") or rec is None:
        row.note = _WHOLE_MODEL.get(change.kind, _WHOLE_MODEL["module"])
        return row
    if rec.problem is not None:
        row.result, row.note = "unchecked", rec.problem
        return row
    args, kwargs = move_tensors(rec.args, device), move_tensors(rec.kwargs, device)
    # a module's call runs its hooks; its forward alone is what the original's numbers were recorded from
    call = (patched if change.kind == "hooks added" else patched.forward) if isinstance(patched, nn.Module) else patched
    try:
        with torch.no_grad(), same_draws(patched if isinstance(patched, nn.Module) else None):
            got = call(*clone_tensors(args), **clone_tensors(kwargs))
    except Exception as exc:  # noqa: BLE001  (a kernel that cannot run here is reported, never passed)
        row.result, row.note = "unchecked", f"the patched {_kind(change)} raised {type(exc).__name__}: {_short(exc)}"
        return row
    result = compare(got, rec.expected)
    row.max_abs = result[0]
    if is_exact(result):
        row.result, row.ratio = "same", 0.0
        return row
    passed, note = judge(got, rec.expected, rec.truth)
    row.ratio, row.note = _ratio(got, rec.expected, rec.truth), note
    explanation = _explain(change, original, args, kwargs, rec.expected, got, rec.truth)
    # one rule for where a kernel rounds, whatever the op: another cast order or precision is judged by its
    # accuracy (below), as a kernel no declaration reproduces is; another scale, activation or layout differs
    rounding = bool(explanation and explanation.another and set(explanation.keys) <= ROUNDING_KEYS)
    row.result = "passes" if passed and not (explanation and explanation.another and not rounding) else "differs"
    if explanation is not None:
        row.explanation = explanation.text
        if explanation.another and explanation.exact:  # another declaration, reproduced: exact arithmetic's finding
            rounding = set(explanation.keys) <= ROUNDING_KEYS  # where it rounds only: an emulator's reading may decide
            row.evidence = "rounding order" if rounding else "exact arithmetic"
        if row.result == "differs" and not explanation.another and explanation.exact:
            row.explanation = (f"the declaration the original computes ({explanation.original}), beyond its "
                               "rounding error: the kernel's own arithmetic differs, not the declaration")
    if row.result == "passes" and (rounding or not (explanation and explanation.exact)):
        coarser = less_accurate(got, rec.expected, rec.truth)
        if coarser is not None and rounding:  # another rounding order, and a coarser one
            row.result = "differs"
            row.note = (f"its mean error against fp64 is {coarser:.2f}x the original's: it rounds more than the "
                        "original, not only otherwise")
            row.explanation = f"{row.explanation}; {row.note}" if row.explanation else ""
        elif coarser is not None:  # nothing we know reproduces it, and it is further from fp64 than the original
            row.result = "differs"
            row.note = (f"no declaration reproduces it to the ulp, and its mean error against fp64 is {coarser:.2f}x "
                        "the original's: it rounds more (a step in a lower precision), not only otherwise")
            row.explanation = f"{row.explanation}; {row.note}" if row.explanation else ""
        elif rounding:  # another rounding order, no coarser: as a kernel that rounds once less passes, any op
            row.note = (f"{row.note}; " if row.note else "") + (
                "it rounds otherwise (another cast order or precision), within the original's rounding error and not "
                "less accurate against fp64: passes, as a fused kernel that rounds once less passes")
    if change.judged == "through":
        row.note = (row.note + "; " if row.note else "") + f"judged by running {_via(change)} again with it in place"
    return row


def _via(change: Change) -> str:
    return change.via if isinstance(change.via, str) else ".".join(change.via)


#: A kernel whose mean error against fp64 is this much above the original's rounds more than the original does.
COARSER = 1.15


def less_accurate(got: Any, expected: Any, truth: Any) -> float | None:
    """The worst tensor's mean |got - truth| over mean |original - truth| where above :data:`COARSER`; else None.

    Why the mean: a kernel that orders a sum otherwise or rounds once where the reference rounds
    twice is as far from fp64 as the original on average (its worst element may be either); one
    that computes a step in a lower precision (a norm's variance in bf16) is further on average,
    by 30% and more (benchmarks in docs/audit.md), while still within ``k`` times the original's worst.
    """
    worst = None
    for g, o, t in zip(tensors_of(got), tensors_of(expected), tensors_of(truth), strict=False):
        if not (isinstance(g, torch.Tensor) and isinstance(o, torch.Tensor) and isinstance(t, torch.Tensor)):
            continue
        if g.shape != o.shape or g.numel() < 64 or not g.is_floating_point():
            continue
        mine = float((g.double() - t.double()).abs().mean())
        theirs = float((o.double() - t.double()).abs().mean())
        if theirs > 0 and mine > COARSER * theirs:
            worst = max(worst or 0.0, mine / theirs)
    return worst


def judge_registry(change: Change, model: nn.Module, records: dict[Any, Recorded], device: torch.device) -> Row:
    """A registry entry a patch replaced: an attention implementation is judged on the attention's recorded inputs.

    Why: ``ALL_ATTENTION_FUNCTIONS`` is looked up by the config's implementation while the model runs;
    the model here may run another one (a tiny model runs eager, a checkpoint loads with sdpa), so a
    replaced entry the whole model never ran is judged on its own, against the entry it replaced, on
    the inputs the original's eager attention was called with (every implementation takes the same
    arguments); where there are none, it is ``unchecked``, never passed.
    """
    process = change.via
    row = Row(change.path, "-", change.kind, change.detail, "whole model")
    running = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if process.owner.startswith("torch.optim."):  # a global optimizer hook: it runs only when a step is taken
        row.result = "unchecked"
        row.note = ("a global optimizer hook runs at every optimizer step of every optimizer in the process; the "
                    "audit takes no optimizer step, so nothing here ran it (it is put back after the audit)")
        return row
    if "ATTENTION" not in process.owner.upper():
        row.note = "a registry the model's code looks names up in (activations when a model is built): judged by the " \
                   "whole-model checks"
        return row
    if process.key == running:
        row.note = f"the attention this model runs ({running}): judged by the whole-model checks"
        return row
    rec = next((r for k, r in records.items() if isinstance(k, tuple) and k[1] == "eager_attention_forward"), None)
    before, after = process.before, process.after
    if not callable(before):  # a key set in the instance's own mapping, in front of the library's: that one it replaced
        from transformers.modeling_utils import AttentionInterface

        before = AttentionInterface._global_mapping.get(process.key)
    if rec is None or rec.problem or not callable(before) or not callable(after):
        row.result = "unchecked"
        row.note = (f"this model ran {running} attention: the replaced {process.key!r} entry never ran and no recorded "
                    f"attention inputs can run it; audit a model loaded with attn_implementation={process.key!r}")
        return row
    args, kwargs = move_tensors(rec.args, device), move_tensors(rec.kwargs, device)
    try:
        with torch.no_grad(), same_draws(None):
            want = before(*clone_tensors(args), **clone_tensors(kwargs))[0]
        with torch.no_grad(), same_draws(None):
            got = after(*clone_tensors(args), **clone_tensors(kwargs))[0]
    except Exception as exc:  # noqa: BLE001
        row.result, row.note = "unchecked", f"the entry raised {type(exc).__name__}: {_short(exc)}"
        return row
    truth = tensors_of(rec.truth)[0]
    result = compare(got, want)
    row.max_abs = result[0]
    where = (f"judged against the entry it replaced on the eager attention's recorded inputs (this model ran "
             f"{running}; checkpoints load with sdpa unless their config says otherwise)")
    if is_exact(result):
        row.result, row.ratio, row.note = "same", 0.0, where
        return row
    passed, note = judge(got, want, truth)
    row.ratio = _ratio(got, want, truth)
    row.result = "passes" if passed else "differs"
    row.note = f"{note}; {where}" if note else where
    return row


#: Why a change is judged by the whole-model checks only, by its kind.
_WHOLE_MODEL = {
    "module": "judged by the whole-model checks (it holds the decoder layers, or the original's run never called it)",
    "library function rebound": "a library function the model's code may call (a loss calls torch's cross_entropy): "
                                "judged by the whole-model checks",
    "module rebound": "a module a library's code calls through (transformers' sdpa calls torch.nn.functional through "
                      "its ``torch``): judged by the whole-model checks",
    "process setting changed": "every model in the process runs under it: judged by the whole-model checks, and put "
                               "back after the audit",
}


def _explain(change: Change, original: Any, args: Any, kwargs: Any, expected: Any, got: Any,
             truth: Any) -> Explanation | None:
    if isinstance(original, nn.Module):
        return explain_module(original, args, kwargs, expected, got, truth)
    name = change.path.rsplit(".", 1)[-1] if change.judged != "through" else _via(change).rsplit(".", 1)[-1]
    return explain_function(name, original, args, kwargs, expected, got, truth)


def _ratio(got: Any, expected: Any, truth: Any) -> float:
    """The largest difference from the original over the original's own error vs fp64 (per tensor, the worst)."""
    worst = 0.0
    for g, o, t in zip(tensors_of(got), tensors_of(expected), tensors_of(truth), strict=False):
        if not isinstance(o, torch.Tensor):
            continue
        if not isinstance(g, torch.Tensor) or g.shape != o.shape:
            return float("inf")
        diff = max_abs_diff(g, o)
        if diff == 0.0:
            continue
        noise = max_abs_diff(o, t) if isinstance(t, torch.Tensor) else 0.0
        worst = max(worst, diff / noise if noise else float("inf"))
    return worst


def _kind(change: Change) -> str:
    return "function" if change.judged == "function" else "forward"


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + "..."
