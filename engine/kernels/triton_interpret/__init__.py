"""Run vendor Triton kernels (liger, fla) on CPU tensors with Triton's own interpreter, in-process.

Why: on a machine without a GPU, ``verify --device cuda --interpret`` runs the very kernel
code a CUDA plan would run (our arguments, layouts, dtypes, chunk sizes) and judges it with
the usual verifier. Triton's interpreter (``TRITON_INTERPRET=1``) runs most of that code
already; what stops it is a handful of gaps, closed by named shims, one module per group:
:mod:`.launch` (``launch``, ``libdevice``), :mod:`.arguments` (``float_args``, ``loop_index``),
:mod:`.numerics` (``bf16``, ``tf32``, ``bf16_atomic``), :mod:`.autotune` (``autotune``). Nothing
of them is active outside :func:`interpreting` (a context manager): every attribute a shim
replaces is put back on exit, so a process that never asks for interpretation runs triton
exactly as installed.

Each shim names the gap it closes and how to tell that triton no longer needs it (:data:`SHIMS`).

In-process, not a subprocess: ``TRITON_INTERPRET`` is read when a kernel is *decorated*
(``triton.jit`` returns a ``JITFunction`` or an ``InterpretedFunction``), and liger and fla
are imported long before (transformers imports fla); see :mod:`.launch`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from engine.kernels.triton_interpret import arguments, autotune, launch, numerics
from engine.kernels.triton_interpret._state import Shim, undo_all

__all__ = ["SHIMS", "Shim", "interpreting", "is_interpreting"]

#: Every shim, in the order they are installed.
SHIMS: tuple[Shim, ...] = launch.SHIMS + arguments.SHIMS + autotune.SHIMS + numerics.SHIMS

_lock = threading.RLock()
_depth = 0


def is_interpreting() -> bool:
    """Whether :func:`interpreting` is active (in any thread: the shims are process-wide while it is)."""
    return _depth > 0


@contextlib.contextmanager
def interpreting() -> Iterator[None]:
    """Within this block, every Triton kernel launch runs on the CPU with Triton's interpreter.

    Re-entrant. Imports triton on entry (the caller asked for it); raises
    :class:`engine.errors.MissingDependency` when triton is not installed.
    """
    global _depth
    with _lock:
        if _depth == 0:
            _activate()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                undo_all()


def _activate() -> None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        from engine.errors import MissingDependency

        raise MissingDependency("interpreting Triton kernels needs triton (pip install triton; the cuda and fla "
                                f"extras install it): import failed: {exc}") from exc
    try:
        for group in (launch, arguments, autotune, numerics):
            group.install()
    except BaseException:
        undo_all()
        raise
