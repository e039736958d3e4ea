"""transformers' import-time kernel bindings, seen through, and a torch path for reference runs.

transformers decorates some module-level functions (the Qwen3-Next / Qwen3.5 gated delta
rule, the causal conv1d helpers) with ``use_kernel_func_from_hub_with_fallback(name,
package)``: at *import* time, if ``package`` (e.g. ``fla``) imports, the module attribute
becomes a wrapper that always calls that package's kernel, on every device. With
flash-linear-attention installed, a Qwen3-Next forward on CPU therefore fails
(``RuntimeError: 0 active drivers``), patched or not, unless the call is routed elsewhere.

This module gives the engine two things:

* :func:`torch_body`: the torch function transformers wrote, seen through that wrapper
  (and through our own router), for use as a reference;
* :func:`torch_path`: a context manager under which a model's calls of such functions run
  their torch body instead of the bound package, for this thread of execution only (it
  goes through :mod:`engine.runtime.routing`, so a *patched* model's own kernels still win). The
  verifier runs its unpatched reference under it; tests use it for the same reason.

Both see through our router and HF ``kernels``' ``Func`` modules (:mod:`engine.foundation.see_through`),
which transformers wraps around these wrappers too when ``kernels`` is installed.
The wrapper is recognised by its closure (``torch_function`` and ``implementation``),
i.e. by how transformers 5.x builds it; a test pins this against the installed version.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from engine.foundation.see_through import see_through
from engine.runtime import routing

__all__ = ["bound_functions", "hub_binding", "torch_body", "torch_path"]


def _closure(fn: Any) -> dict[str, Any]:
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None)
    if code is None or not cells:
        return {}
    out: dict[str, Any] = {}
    for name, cell in zip(code.co_freevars, cells, strict=False):
        try:
            out[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    return out


def hub_binding(fn: Any) -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """``(torch_function, implementation)`` if ``fn`` is transformers' fallback wrapper, else ``None``."""
    cells = _closure(see_through(fn))
    torch_fn, impl = cells.get("torch_function"), cells.get("implementation")
    if callable(torch_fn) and callable(impl):
        return torch_fn, impl
    return None


def torch_body(fn: Any) -> Any:
    """The torch function behind ``fn``: through our router, a ``kernels`` ``Func`` and transformers' binding."""
    binding = hub_binding(fn)
    return binding[0] if binding is not None else see_through(fn)


def _calls(cls: type) -> Iterator[tuple[dict[str, Any], str]]:
    """``(globals, name)`` for every global name ``cls.forward`` (through decorators) refers to."""
    forward = getattr(cls, "forward", None)
    for _ in range(16):
        if forward is None:
            return
        code = getattr(forward, "__code__", None)
        if code is not None:  # every level: a decorator's wrapper names other globals than the body
            for name in code.co_names:
                yield forward.__globals__, name
        forward = getattr(forward, "__wrapped__", None)


def bound_functions(model: nn.Module) -> dict[tuple[str, str], Callable[..., Any]]:
    """Functions the model's forwards call that transformers bound to a package: ``{(module, name): torch_body}``."""
    found: dict[tuple[str, str], Callable[..., Any]] = {}
    for cls in {type(m) for m in model.modules()}:
        for namespace, name in _calls(cls):
            value = namespace.get(name)
            binding = hub_binding(value) if callable(value) else None
            if binding is not None and binding[1] is not binding[0]:
                found[(namespace["__name__"], name)] = binding[0]
    return found


@contextlib.contextmanager
def torch_path(model: nn.Module) -> Iterator[dict[tuple[str, str], Callable[..., Any]]]:
    """Run ``model``'s package-bound functions on their torch body inside the block.

    Scoped like a function patch: other threads and tasks are unaffected, and a patched
    model still calls the kernels its plan chose. Yields the functions it rerouted (empty
    when nothing is bound, e.g. without flash-linear-attention installed).

    Example:
        >>> with engine.torch_path(model):          # doctest: +SKIP
        ...     reference = model(input_ids).logits  # runs on CPU even with fla installed
    """
    bound = bound_functions(model)
    entered: list[tuple[routing.FunctionRouter, Any, tuple[str, str]]] = []
    try:
        for (namespace, name), body in bound.items():
            router = routing.acquire(namespace, name)
            entered.append((router, router.active.set(body), (namespace, name)))
        yield bound
    finally:
        for router, token, (namespace, name) in reversed(entered):
            router.active.reset(token)
            routing.release(namespace, name)
