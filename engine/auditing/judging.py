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
from engine.auditing.explain import Explanation, explain_function, explain_module
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
    if change.judged != "module" and change.judged != "function" or rec is None:
        row.note = _WHOLE_MODEL.get(change.kind, _WHOLE_MODEL["module"])
        return row
    if rec.problem is not None:
        row.result, row.note = "unchecked", rec.problem
        return row
    args, kwargs = move_tensors(rec.args, device), move_tensors(rec.kwargs, device)
    call = patched.forward if isinstance(patched, nn.Module) else patched
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
    explanation = _explain(change, original, args, kwargs, rec.expected, got)
    row.result = "passes" if passed and not (explanation and explanation.another) else "differs"
    if explanation is not None:
        row.explanation = explanation.text
        if row.result == "differs" and not explanation.another and explanation.original is not None:
            row.explanation = (f"the declaration the original computes ({explanation.original}), beyond its "
                               "rounding error: the kernel's own arithmetic differs, not the declaration")
    return row


#: Why a change is judged by the whole-model checks only, by its kind.
_WHOLE_MODEL = {
    "module": "judged by the whole-model checks (it holds the decoder layers, or the original's run never called it)",
    "library function rebound": "a library function the model's code may call (a loss calls torch's cross_entropy): "
                                "judged by the whole-model checks",
}


def _explain(change: Change, original: Any, args: Any, kwargs: Any, expected: Any, got: Any) -> Explanation | None:
    if isinstance(original, nn.Module):
        return explain_module(original, args, kwargs, expected, got)
    return explain_function(change.path.rsplit(".", 1)[-1], original, args, kwargs, expected, got)


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
