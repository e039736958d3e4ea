"""A long command's progress: a tqdm bar on a terminal, one plain line a step in a log, nothing with ``--quiet``.

Why: ``patch-engine coverage`` verifies a hundred patchsets for minutes and printed nothing until
its table; users of Hugging Face tooling expect a bar with what is running (tqdm, as transformers
and accelerate draw theirs), and a CI log needs lines it can keep, not a bar's carriage returns.
Everything goes to stderr, so the command's output (a table, JSON) stays clean on stdout.
"""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["Steps"]


class Steps:
    """``step(text)`` after each of ``total`` steps, ``note(text)`` within one; ``close()`` at the end (also as a
    context manager)."""

    def __init__(self, total: int, what: str, *, quiet: bool = False, stream: Any = None):
        self.total, self.what, self.done, self.quiet = total, what, 0, quiet
        self.stream = sys.stderr if stream is None else stream
        self.started = time.perf_counter()
        self.bar = None
        if not quiet and getattr(self.stream, "isatty", lambda: False)():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, desc=what, unit="step", file=self.stream, leave=False)

    def step(self, text: str) -> None:
        self.done += 1
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(text[:60], refresh=False)
            self.bar.update(1)
        else:
            elapsed = time.perf_counter() - self.started
            print(f"{self.what} {self.done}/{self.total} ({elapsed:.0f} s): {text}", file=self.stream, flush=True)

    def note(self, text: str) -> None:
        """Where a step has come, without finishing it (a verification's modules checked so far, a patch's condition)."""
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(text[:60], refresh=True)
        else:
            elapsed = time.perf_counter() - self.started
            print(f"{self.what} {self.done}/{self.total} ({elapsed:.0f} s): {text}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> Steps:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
