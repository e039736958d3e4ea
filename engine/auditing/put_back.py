"""A process-wide change judged by the whole model only, located by putting it back and running the model again.

Why: ``torch.rsqrt`` or ``torch.nn.functional.softmax`` rebound by a patch reaches every model, and the
audit has no recorded call of such a library function to judge it on: the whole model differed and the
report named nothing. Where a whole-model check fails, each such change (a library function, a class
attribute, a registry entry, judged by the whole model only) is put back in turn and the patched model runs
again; if every check that failed then passes, that change is what moved them, and its row says so. The
patch's own object is put back in place after each run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from engine.auditing.process_state import ProcessChange, put_back
from engine.verification.results import Check

__all__ = ["locate_by_putting_back"]

#: At most this many changes are tried (each costs one run of the patched model and its judgement).
MOST_TRIED = 16


@contextlib.contextmanager
def _undone(change: ProcessChange) -> Iterator[None]:
    put_back(change, change.before)
    try:
        yield
    finally:
        put_back(change, change.after)


def locate_by_putting_back(rows: list[Any], checks: list[Check], changes: dict[str, ProcessChange],
                           rerun: Callable[[], list[Check]], ratios: dict[str, float]) -> None:
    """Mark the row of each whole-model-only process change without which the failed checks pass."""
    failed = [c.what for c in checks if not c.passed]  # logits, loss, grads: in the checks' order
    if not failed:
        return
    tried = [r for r in rows if r.result == "whole model" and r.path in changes][:MOST_TRIED]
    for row in tried:
        with _undone(changes[row.path]):
            again = rerun()
        if any(not c.passed for c in again if c.what in failed):
            continue
        worst = max((ratios.get(what.split(" ")[0], 0.0) for what in failed), default=0.0)
        row.result, row.evidence, row.ratio = "differs", "put back", worst or None
        row.note = (f"with it put back, the whole model's {', '.join(failed)} pass: this change is what "
                    "moves them")
