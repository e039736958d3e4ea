"""Inductor's CPU build, imported without a note about CUDA that does not concern it.

Why a module of its own: :mod:`engine.kernels.compiled` calls it before its first compile, and
it is about torch's environment, not about what is compiled.
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch

__all__ = ["import_cpp_extension_quietly"]


def _not_the_note(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("No CUDA runtime is found")


@functools.lru_cache(maxsize=1)
def import_cpp_extension_quietly() -> None:
    """Import ``torch.utils.cpp_extension`` (inductor's CPU build does) without its "No CUDA runtime" note.

    Why: with PyPI's CUDA build of torch on a machine that has a CUDA toolkit (``nvcc`` on the PATH)
    but no GPU, that module logs "No CUDA runtime is found, using CUDA_HOME=..." when it is first
    imported, which a compiled kernel's first call triggers: every CLI call printed it, about CUDA,
    for a C++ kernel of the CPU. That one record is dropped; anything else the module logs is not.
    """
    if torch.cuda.is_available():
        return
    log = logging.getLogger("torch.utils.cpp_extension")
    log.addFilter(_not_the_note)
    try:
        importlib.import_module("torch.utils.cpp_extension")
    except Exception:  # inductor's own import will say what is wrong
        pass
    finally:
        log.removeFilter(_not_the_note)
