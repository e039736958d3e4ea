"""Exceptions that are not a kernel's failure: a catch-all around a kernel call must let them through.

Why a list of its own: a kernel call wrapped in ``except Exception`` (the compiled kernels fall
back to the torch reference when compiling fails) took torch's non-reentrant activation
checkpoint's early stop for a broken kernel: the recompute raises ``_StopRecomputationError``
once it has recomputed the last tensor the backward needs, and a catch-all that reran the reference
inside the recompute and marked the kernel failed for good broke the checkpoint
(``AssertionError: Unexpected state: target_frame.early_stop is set``; Gemma 3, whose last saved
tensor comes out of a compiled norm). Running out of memory is not a broken kernel either: falling
back would allocate again, and disabling the kernel for good would hide the cause.

The ones let through (each tested in tests/test_compiled.py):

* ``torch.utils.checkpoint._StopRecomputationError``: the non-reentrant checkpoint's early stop
  (a control-flow exception by design: torch raises it to unwind the recompute);
* ``torch.OutOfMemoryError`` (CUDA, XPU, ... out of memory) and ``MemoryError`` (the host's).

``KeyboardInterrupt``, ``SystemExit`` and ``GeneratorExit`` are not ``Exception`` subclasses, so an
``except Exception`` never catches them.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["not_a_failure"]


@functools.lru_cache(maxsize=1)
def not_a_failure() -> tuple[type[BaseException], ...]:
    """The exception types an ``except Exception`` around a kernel call must re-raise untouched."""
    found: list[type[BaseException]] = [MemoryError]
    out_of_memory = getattr(torch, "OutOfMemoryError", None)
    if isinstance(out_of_memory, type):
        found.append(out_of_memory)
    from torch.utils import checkpoint

    stop = getattr(checkpoint, "_StopRecomputationError", None)
    if isinstance(stop, type):
        found.append(stop)
    return tuple(found)
