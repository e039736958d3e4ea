"""Scoping a module-level function replacement to one model.

transformers' attention forwards call ``apply_rotary_pos_emb`` (and the linear-attention
helpers) by global name, so the only place to intercept them is the modeling module's
namespace, which every model of that family in the process shares. To patch it for one
model only, the engine installs a *router* there once: it calls the original function,
unless the call happens inside the forward of a module of a patched model, which names its
kernel for the duration of its forward. Other models, and this model after
:func:`engine.revert`, reach the original. The router is removed when the last model using
it is reverted.

Two ways to name the kernel, one per mode, so that a patched model compiles wherever the
unpatched one does (``fullgraph=True`` included):

* eager: a context variable (:attr:`FunctionRouter.active`), set and reset around the
  caller's forward. Why: it is per thread and per asyncio task, so two models of one family
  running concurrently each reach their own kernel.
* while dynamo traces (``torch.compiler.is_compiling()``, which dynamo folds to a constant):
  a plain list used as a stack (:attr:`FunctionRouter.traced`), pushed and popped around the
  caller's forward. Why: dynamo cannot trace ``ContextVar.set`` or ``.get`` (an
  ``Unsupported`` error under ``fullgraph=True``, a graph break per call site otherwise), but
  it traces a list's append / pop / ``[-1]`` as side effects it models itself, so the
  routed call becomes a constant call of the kernel in the graph. Push and pop happen in the
  same trace; the list is empty outside a forward.

An eager forward whose inner call dynamo compiles separately (a user compiling one
submodule's forward) is the one mix that falls back to the original function: the compiled
code cannot read the context variable.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from engine.foundation.see_through import kernels_function, see_through

__all__ = ["FunctionRouter", "acquire", "release", "router_for"]


class FunctionRouter:
    """Stands in for ``namespace[name]``; dispatches to the kernel of the calling model, if any."""

    def __init__(self, namespace: dict[str, Any], name: str):
        self.namespace = namespace
        self.name = name
        self.original: Callable[..., Any] = namespace[name]
        self.active: ContextVar[Callable[..., Any] | None] = ContextVar(f"patch_engine.{name}", default=None)
        #: The kernels of the callers whose forwards dynamo is tracing, innermost last.
        self.traced: list[Callable[..., Any]] = []
        self.users = 0
        #: Callbacks ``(args, kwargs)`` run on every routed call; verification uses them to
        #: capture real inputs and to prove that the function is called at all.
        self.observers: list[Callable[[tuple[Any, ...], dict[str, Any]], None]] = []
        original, active, traced, observers = self.original, self.active, self.traced, self.observers
        compiling = torch.compiler.is_compiling

        # Looks like the function itself (its name, signature, ``__wrapped__``) even when the
        # name holds a ``kernels`` ``Func`` module; calls and revert still use ``original``.
        @functools.wraps(see_through(original))
        def routed(*args: Any, **kwargs: Any) -> Any:
            if compiling():
                impl = traced[-1] if traced else None
            else:
                # `traced` is non-empty here only when a compiled caller broke its graph around this call
                impl = active.get() or (traced[-1] if traced else None)
            if observers:
                for observe in observers:
                    observe(args, kwargs)
            if impl is None:
                return original(*args, **kwargs)
            return impl(*args, **kwargs)

        routed.__patch_engine_router__ = self  # type: ignore[attr-defined]
        self.function: Any = routed
        if kernels_function(original) is not None:
            self.function = _as_kernels_func(original, routed, self)

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace["__name__"], self.name)


def _as_kernels_func(original: Any, routed: Callable[..., Any], router: FunctionRouter) -> Any:
    """The router as a fresh instance of the ``kernels`` ``Func`` class that held the name, calling ``routed``.

    Why: where HF ``kernels`` is installed (a dependency of transformers since 5.25), a modeling
    module's ``apply_rotary_pos_emb`` is an instance of a one-off ``Func`` module class, and every
    attention module keeps a private copy of it (``_kernel_funcs``). Pickling, ``torch.save`` and
    ``copy.deepcopy`` rebuild those copies as ``type(getattr(modeling_module, name))()``
    (``kernels``' ``_rebuild_kernel_func``): with a plain function there, that is
    ``function()``, a ``TypeError``, for any model of the family while another is patched. As a
    ``Func`` whose instance ``forward`` is the router (the way ``kernelize`` installs a kernel),
    the rebuild finds the class it expects; calls go to ``routed``, which calls ``original``
    (whose own forward still dispatches to the calling attention's private copy).
    """
    holder = type(original)()
    holder.forward = routed
    holder.__patch_engine_router__ = router
    holder.__wrapped__ = routed.__wrapped__  # inspect.signature reads the function's, as of the plain router
    return holder


_ROUTERS: dict[tuple[str, str], FunctionRouter] = {}


def router_for(namespace_name: str, name: str) -> FunctionRouter | None:
    return _ROUTERS.get((namespace_name, name))


def acquire(namespace_name: str, name: str) -> FunctionRouter:
    """Install (or reuse) the router for ``namespace_name.name`` and count one more user."""
    key = (namespace_name, name)
    router = _ROUTERS.get(key)
    namespace = vars(sys.modules[namespace_name])
    if router is None or namespace.get(name) is not router.function:
        router = FunctionRouter(namespace, name)
        namespace[name] = router.function
        _ROUTERS[key] = router
    router.users += 1
    return router


def release(namespace_name: str, name: str) -> None:
    """One user fewer; the last one puts the original function back."""
    key = (namespace_name, name)
    router = _ROUTERS.get(key)
    if router is None:
        return
    router.users -= 1
    if router.users <= 0:
        del _ROUTERS[key]
        if router.namespace.get(name) is router.function:
            router.namespace[name] = router.original


@contextlib.contextmanager
def observing(
    keys: Iterable[tuple[str, str]],
    observer_for: Callable[[tuple[str, str]], Callable[[tuple[Any, ...], dict[str, Any]], None]],
) -> Iterator[None]:
    """Each function of ``keys`` routed while the block runs, ``observer_for(key)`` seeing each call's arguments.

    The routers are acquired for the block and released after it (a router no patch holds is
    removed), so nothing of the observation is left behind: what the scaffold's capture and the
    audit's recording of the original both need.
    """
    attached: list[tuple[FunctionRouter, Callable[[tuple[Any, ...], dict[str, Any]], None], tuple[str, str]]] = []
    try:
        for key in keys:
            router = acquire(*key)
            observe = observer_for(key)
            router.observers.append(observe)
            attached.append((router, observe, key))
        yield
    finally:
        for router, observe, key in attached:
            router.observers.remove(observe)
            release(*key)

