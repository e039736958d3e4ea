"""Importing a training stack's module on first use, or saying what to install.

Why one function: every integration imports its stack lazily (``import engine.integrations.x``
must not need the stack), and a missing stack must read the same everywhere: our
:class:`~engine.errors.MissingDependency`, naming who needs it, the module and the pip line.
"""

from __future__ import annotations

import importlib
from typing import Any

from engine.errors import MissingDependency

__all__ = ["import_stack_module"]


def import_stack_module(module: str, *, needs: str, install: str) -> Any:
    """``importlib.import_module(module)``, or :class:`MissingDependency` (``needs``: who needs it and what).

    Example:
        >>> import_stack_module("twinkle.patch.base", needs="engine.integrations.twinkle needs twinkle",
        ...                     install='pip install "twinkle-kit==0.5.1"')  # doctest: +SKIP
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingDependency(f"{needs} ({module}): {install} ({type(exc).__name__}: {exc})") from exc
