"""A rebound function that writes into the tensors it is given, located by the whole model's own numbers.

Why: Liger's ``cross_entropy`` (rebound on ``torch.nn.functional``) stores the loss's gradient in its
input to save memory. The input is the model's logits: in fp32 ``logits.float()`` is the same tensor, so
the logits the model returns are overwritten with the loss's gradient (granite fp32: 7.6e5x the
original's own error) while the loss and every gradient are right; in bf16 ``.float()`` makes a copy
and nothing shows. Such a library function is judged by the whole model only (the audit has no
recorded call of it), so the finding named no change.

Where a whole-model check fails, each rebound function judged by the whole model only is wrapped, in
turn, so that it gets copies of its tensor arguments (copies that keep their graph), and the patched
model runs again. If the checks that failed then pass, that function's write is the cause, and its row
says so. The wrapper is set where the patch put the function and the patch's own object put back after.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

from engine.auditing.process_state import ProcessChange, put_back
from engine.auditing.put_back import explained_by_rerunning
from engine.verification.compare import clone_tensors
from engine.verification.results import Check

__all__ = ["locate_written_inputs"]


@contextlib.contextmanager
def _given_copies(change: ProcessChange) -> Iterator[None]:
    """``change``'s new object, for the block, called with copies of its tensor arguments."""
    patched = change.after

    @functools.wraps(patched)
    def copying(*args: Any, **kwargs: Any) -> Any:
        return patched(*clone_tensors(args), **clone_tensors(kwargs))

    put_back(change, copying)
    try:
        yield
    finally:
        put_back(change, patched)


def locate_written_inputs(rows: list[Any], checks: list[Check], changes: dict[str, ProcessChange],
                          rerun: Callable[[], list[Check]], ratios: dict[str, float]) -> None:
    """Mark the row of a whole-model-only function whose write into its arguments explains the failed checks."""
    contexts = {path: (lambda c=change: _given_copies(c)) for path, change in changes.items()
                if change.kind == "function" and callable(change.after)}
    for row, failed in explained_by_rerunning(rows, checks, contexts, rerun, ratios):
        row.evidence = "in-place input"
        row.note = (f"writes into a tensor it is given (in place): with copies of its arguments, the whole model's "
                    f"{failed} pass: it overwrites a tensor the model still holds (a loss that stores its gradient in "
                    "the logits it is given, which an fp32 model returns)")
