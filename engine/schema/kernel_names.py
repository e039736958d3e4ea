"""The kernel names a patchset may use, without importing a kernel (or torch).

Why a table of its own: validating a patchset (``patch-engine validate``, a pre-commit hook,
a CI schema job) must not import torch and every op just to learn which names exist. The
bundled provider names are listed here; :func:`engine.kernels.registry.register` adds the
name of every provider registered at run time (a plugin), and ``unregister`` takes it away
again. ``tests/test_architecture.py`` checks that :data:`BUNDLED` is exactly the names the
bundled providers register.
"""

from __future__ import annotations

__all__ = ["BUNDLED", "add", "discard", "known"]

#: Names of the providers in ``engine/kernels/`` (``torch`` is every op's reference).
BUNDLED: frozenset[str] = frozenset({"torch", "compiled", "liger", "fla", "npu", "grouped_mm"})

_EXTRA: set[str] = set()


def known() -> set[str]:
    """Every name a patchset's ``kernel`` may use (besides ``auto``)."""
    return set(BUNDLED) | _EXTRA


def add(name: str) -> None:
    """Record a provider name registered at run time."""
    if name not in BUNDLED:
        _EXTRA.add(name)


def discard(name: str) -> None:
    """Forget a run-time name once no provider is registered under it."""
    _EXTRA.discard(name)
