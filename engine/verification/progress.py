"""How far a verification has come: modules checked out of the total, and the whole model, as a bar.

Why: on a real checkpoint a verification takes minutes (one check per patched module, in fp32
and bf16, then the whole model against its fp64 truth), and a launcher that prints nothing for
that long looks hung. The bar is tqdm's (transformers' own dependency, and what the launchers'
trainers draw their bars with), on stderr, shown only once the work has taken ``delay`` seconds,
so a tiny model's verification prints nothing.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

__all__ = ["Progress", "ProgressOption"]

#: ``None``: a bar where stderr is a terminal; ``True``/``False``: a bar or not; a callable:
#: ``fn(done, total, what)`` after each step (a launcher's own display, a test).
ProgressOption = bool | Callable[[int, int, str], Any] | None


class Progress:
    """Counts the checks of one verification: one per module or function checked, one for the whole model."""

    def __init__(self, total: int, option: ProgressOption = None, *, delay: float = 2.0):
        self.total, self.done = total, 0
        self.callback = option if callable(option) else None
        show = sys.stderr.isatty() if option is None else option is True
        self.bar = None
        if show:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc="patch-engine verify", unit="check", delay=delay, leave=False,
                            file=sys.stderr)

    def grow(self, more: int) -> None:
        """``more`` steps found once the work has started (the conditions of use chosen after the probe's time)."""
        self.total += more
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def step(self, what: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(what[-40:], refresh=False)
            self.bar.update(1)
        if self.callback is not None:
            self.callback(self.done, self.total, what)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
