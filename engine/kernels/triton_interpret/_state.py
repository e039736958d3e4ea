"""What every shim group shares: the :class:`Shim` record and the undo list of :func:`interpreting`.

Why one place: each group replaces attributes of triton's own objects while interpretation is
active, and all of them must be put back, exactly and in reverse order, when it ends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Shim", "on_exit", "set_attr", "undo_all"]


@dataclass(frozen=True)
class Shim:
    """One interpreter gap: what fails without the shim, what the shim does, how to tell it is obsolete."""

    name: str
    gap: str
    fix: str
    obsolete_when: str


_restore: list[Callable[[], None]] = []


def on_exit(undo: Callable[[], None]) -> None:
    """Run ``undo`` when interpretation ends (last registered, first run)."""
    _restore.append(undo)


def undo_all() -> None:
    """Put back everything the shims replaced, newest first."""
    while _restore:
        _restore.pop()()


def set_attr(obj: Any, name: str, value: Any) -> None:
    """Set ``obj.name`` and remember how to put the old value back (exactly: absent stays absent)."""
    missing = object()
    old = obj.__dict__.get(name, missing) if hasattr(obj, "__dict__") else getattr(obj, name, missing)

    def undo() -> None:
        if old is missing:
            with contextlib.suppress(AttributeError):
                delattr(obj, name)
        else:
            setattr(obj, name, old)

    setattr(obj, name, value)
    _restore.append(undo)
