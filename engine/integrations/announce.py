"""What a launcher shows when it patches a model: one line at its default log level, the report at its verbose one.

Why: a user who adds a patchset to a launcher's config must see, in what the launcher prints
without any setting, that the model was patched, with which kernels, and whether verification ran
and passed (:meth:`~engine.planning.report.Report.summary_line`); a patch that only shows at a
level nobody runs is as good as silent. The per-module table (``str(report)``) is for a closer
look, at the launcher's verbose level. Each launcher has its own output (axolotl's loggers, ms-swift's
and twinkle's ``get_logger``, LlamaFactory's, the ``Trainer``'s printed logs), so each integration
hands over its own two outlets; this module says what is shown, and only on the main process.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from engine.planning.report import Report

__all__ = ["announce", "is_main_process"]


def is_main_process() -> bool:
    """Rank 0 of a distributed run, or a run of one process (``torch.distributed``, else ``$RANK`` as torchrun sets it)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK", "0").strip() in ("0", "")


def announce(report: Report, *, line: Callable[[str], Any], detail: Callable[[str], Any]) -> None:
    """On the main process: ``line(report.summary_line())``, then ``detail`` of the full report.

    Args:
        report: what apply did.
        line: the launcher's outlet at its default level (a logger's ``info``, or ``print``).
        detail: its outlet at the verbose level (a logger's ``debug``).
    """
    if not is_main_process():
        return
    line(report.summary_line())
    detail(f"patch-engine report:\n{report}")
