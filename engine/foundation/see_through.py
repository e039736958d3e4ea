"""The function behind a module-level callable: through our router and HF ``kernels`` wrappers.

Several things may stand where a modeling module defines a function such as
``apply_rotary_pos_emb``:

* our own router (:mod:`engine.runtime.routing`), while some model routes that function;
* with Hugging Face's ``kernels`` package installed, transformers' ``use_kernel_forward_from_hub``
  turns the decorated *function* into an instance of a one-off ``nn.Module`` class ``Func`` at
  import time (``kernels.layer.layer._create_func_module``). Calling it calls the function, but
  ``inspect.signature`` of the instance is ``(*args, **kwargs)`` and it has no source of its own:
  the function is a free variable (``func``) of ``Func.forward``. (Its ``forward.__signature__``
  is patched to the function's, but ``kernelize`` may swap the instance's ``forward`` for a hub
  kernel's, so the closure is the one place that always holds the function transformers wrote.)

Whoever reads a signature, a source or a module name must read them from the function, so every
such reader goes through :func:`see_through`. Whoever *replaces* the name must keep the object it
found (the router calls it and puts it back on revert): see-through is for reading only.

Torch-free on purpose (it only looks at attributes), so the foundation layer can use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["kernels_function", "see_through"]


def kernels_function(obj: Any) -> Callable[..., Any] | None:
    """The function a ``kernels`` ``Func`` module wraps, or ``None`` when ``obj`` is not one.

    Recognised by its shape, not its import path: the class carries ``kernel_layer_name`` (set by
    ``kernels``' ``replace_kernel_forward_from_hub``) and its ``forward`` closes over ``func``. A
    class decorated the same way (an ``RMSNorm``) has no such closure and is not a function.
    """
    cls = type(obj)
    if not hasattr(cls, "kernel_layer_name"):
        return None
    forward = getattr(cls, "forward", None)
    code, cells = getattr(forward, "__code__", None), getattr(forward, "__closure__", None)
    if code is None or not cells or "func" not in code.co_freevars:
        return None
    try:
        inner = cells[code.co_freevars.index("func")].cell_contents
    except ValueError:  # an empty cell
        return None
    return inner if callable(inner) else None


def see_through(fn: Any) -> Any:
    """``fn`` seen through our router and ``kernels`` ``Func`` modules, in any nesting.

    Stops at the first object that is neither (a plain function, transformers' own hub-fallback
    wrapper, a ``functools.wraps`` decorator: ``inspect`` already follows ``__wrapped__``).
    """
    for _ in range(16):  # a chain longer than this is a loop
        router = getattr(fn, "__patch_engine_router__", None)
        if router is not None:
            fn = router.original
            continue
        inner = kernels_function(fn)
        if inner is None:
            return fn
        fn = inner
    return fn
