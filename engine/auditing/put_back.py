"""A change judged by the whole model only, located by putting it back and running the model again.

Why: ``torch.rsqrt`` or ``torch.nn.functional.softmax`` rebound by a patch reaches every model, and the
audit has no recorded call of such a library function to judge it on; a config field a forward reads as it
runs (Gemma 2's ``final_logit_softcapping``) has no module of its own. The whole model differed and the
report named nothing. Where a whole-model check fails, each such change (a library function, a class
attribute, a registry entry, a config field, judged by the whole model only) is put back in turn and the
patched model runs again; if every check that failed then passes, that change is what moved them, and its
row says so. The patch's own value is put back in place after each run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

from torch import nn

from engine.auditing.process_state import ProcessChange, put_back
from engine.auditing.report import check_key, checks_text
from engine.verification.results import Check

__all__ = ["explained_by_rerunning", "locate_by_putting_back", "undoers"]

#: At most this many changes are tried (each costs one run of the patched model and its judgement).
MOST_TRIED = 16

#: A change's undo and redo, by the path its row shows.
Undoers = dict[str, tuple[Callable[[], None], Callable[[], None]]]


def undoers(process: list[ProcessChange], original: nn.Module, patched: nn.Module) -> Undoers:
    """How to put back, and put in place again, each process-wide change and each config field the patch changed."""
    out: Undoers = {}
    for change in process:
        out[change.where] = (lambda c=change: put_back(c, c.before), lambda c=change: put_back(c, c.after))
    theirs, mine = getattr(original, "config", None), getattr(patched, "config", None)
    if theirs is not None and mine is not None:
        for key in set(vars(theirs)) | set(vars(mine)):
            before, after = vars(theirs).get(key, _MISSING), vars(mine).get(key, _MISSING)
            if before is not after:
                out[f"config.{key}"] = (lambda k=key, v=before: _set(mine, k, v),
                                        lambda k=key, v=after: _set(mine, k, v))
    return out


_MISSING = object()


def _set(config: Any, key: str, value: Any) -> None:
    if value is _MISSING:
        vars(config).pop(key, None)
    else:
        vars(config)[key] = value  # the instance's own field: no setter that validates or derives others


@contextlib.contextmanager
def _undone(undo: Callable[[], None], redo: Callable[[], None]) -> Iterator[None]:
    undo()
    try:
        yield
    finally:
        redo()


def explained_by_rerunning(rows: list[Any], checks: list[Check],
                           contexts: dict[str, Callable[[], AbstractContextManager[Any]]],
                           rerun: Callable[[], list[Check]], ratios: dict[str, float]) -> Iterator[tuple[Any, str]]:
    """The whole-model-only rows (at most :data:`MOST_TRIED`) whose context (``contexts[row.path]``) makes every
    failed check pass when the patched model runs again inside it. Each is yielded with the failed checks' names,
    its result already ``differs`` and its ratio the worst failed one; the caller says why (evidence and note).

    The shared mechanism of the locators that judge a change by the whole model's own numbers (this module's,
    and :mod:`engine.auditing.written_inputs`)."""
    failed = [c.what for c in checks if not c.passed]  # logits, loss, grads: in the checks' order
    if not failed:
        return
    worst = max((ratios.get(check_key(what), 0.0) for what in failed), default=0.0)
    for row in [r for r in rows if r.result == "whole model" and r.path in contexts][:MOST_TRIED]:
        with contexts[row.path]():
            again = rerun()
        if any(not c.passed for c in again if c.what in failed):
            continue
        row.result, row.ratio = "differs", worst or None
        yield row, checks_text(failed)


def locate_by_putting_back(rows: list[Any], checks: list[Check], undo: Undoers,
                           rerun: Callable[[], list[Check]], ratios: dict[str, float]) -> None:
    """Mark the row of each whole-model-only change without which the failed checks pass."""
    contexts = {path: (lambda u=u: _undone(*u)) for path, u in undo.items()}
    for row, failed in explained_by_rerunning(rows, checks, contexts, rerun, ratios):
        row.evidence = "put back"
        row.note = f"with it put back, the whole model's {failed} pass: this change is what moves them"
