"""Other packages' warnings kept out of a command's output, unless ``-v``.

Why: an audit printed nine lines before its own header, none of them about the user's patch:
flash-linear-attention's "does not recommend using Triton's conv1d backend", Liger's optional
backends, transformers' deprecations and tiny-config notes. A command's output is its own; with
``-v`` (``--verbose``) every other package's warning and log line shows as before. The engine's
own warnings (:class:`engine.errors.UnverifiedContentWarning` and the others) always show, and a
command that hid any says so, and how to see them, in one line at its end.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = ["others_quiet"]

#: transformers' own switch, read when it is imported (its logger has its own handler and level).
TRANSFORMERS_ENV = "TRANSFORMERS_VERBOSITY"


def _ours(category: type[Warning], filename: str) -> bool:
    """A warning of the engine's own: its category is one of ours, or it was raised from the engine's code."""
    engine_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return category.__module__.split(".")[0] == "engine" or os.path.abspath(filename).startswith(engine_dir + os.sep)


class _Others(logging.Filter):
    """Passes the engine's log records; counts and drops every other package's."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.split(".")[0] == "engine":
            return True
        self.hidden += 1
        return False


@contextlib.contextmanager
def others_quiet(verbose: bool = False) -> Iterator[None]:
    """For the command's time: other packages' warnings and log lines dropped (counted), unless ``verbose``; the
    engine's own in the command line's words (:func:`engine.commands.cli_words.for_cli`)."""
    if verbose:
        with warnings.catch_warnings():
            shown = warnings.showwarning
            warnings.showwarning = lambda message, category, *rest: shown(_words(message, category), category, *rest)
            yield
        return
    hidden = _Others()
    handler = logging.StreamHandler(sys.stderr)  # where logging's last resort would have written them
    handler.setLevel(logging.WARNING)
    handler.addFilter(hidden)
    root = logging.getLogger()
    root.addHandler(handler)
    restore = _transformers_quiet()
    dropped = 0
    try:
        with warnings.catch_warnings():
            shown = warnings.showwarning

            def show(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None,
                     line: str | None = None) -> None:
                nonlocal dropped
                if _ours(category, filename):
                    shown(_words(message, category), category, filename, lineno, file, line)
                else:
                    dropped += 1

            warnings.showwarning = show
            yield
    finally:
        root.removeHandler(handler)
        restore()
        if dropped or hidden.hidden:  # transformers' own are hidden by its level, uncounted
            print("(other packages' warnings hidden: -v shows them)", file=sys.stderr)


def _words(message: Any, category: type[Warning]) -> Any:
    """An engine warning's text as the command line says it (``--unverified trust``); any other as it came."""
    if category.__module__.split(".")[0] != "engine":
        return message
    from engine.commands.cli_words import for_cli

    return category(for_cli(str(message)))


def _transformers_quiet() -> Any:
    """transformers' warnings off (errors still shown); returns what puts its setting back."""
    if "transformers" not in sys.modules:  # read at import: the command imports it later, if at all
        before = os.environ.get(TRANSFORMERS_ENV)
        os.environ[TRANSFORMERS_ENV] = "error"

        def restore() -> None:
            if before is None:
                os.environ.pop(TRANSFORMERS_ENV, None)
            else:
                os.environ[TRANSFORMERS_ENV] = before
            if "transformers" in sys.modules:  # imported meanwhile, at error level: back to its default
                _set_transformers_level(before)
        return restore
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    return lambda: hf_logging.set_verbosity(level)


def _set_transformers_level(name: str | None) -> None:
    from transformers.utils import logging as hf_logging

    levels = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR,
              "critical": logging.CRITICAL}
    hf_logging.set_verbosity(levels.get((name or "warning").lower(), logging.WARNING))
