"""Shims ``launch`` and ``libdevice``: hand launches of already-decorated kernels to Triton's interpreter.

Why: ``TRITON_INTERPRET`` is read when ``triton.jit`` decorates a kernel, and liger and fla are
imported long before interpretation is asked for (transformers imports fla). A launch of a
decorated ``JITFunction`` therefore runs an ``InterpretedFunction`` of the same Python function,
exactly what the decorator would have built under the variable; libdevice stubs in the kernel's
module are bound to interpretable functions on the way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.kernels.triton_interpret._state import Shim, on_exit, set_attr

__all__ = ["SHIMS", "install"]

SHIMS: tuple[Shim, ...] = (
    Shim("launch",
         "TRITON_INTERPRET is read when triton.jit decorates a kernel (triton/runtime/jit.py, `jit`): "
         "kernels of a package imported before cannot be interpreted by setting it later",
         "a launch (JITFunction.run) or a nested call (JITFunction.__call__) of a decorated kernel runs "
         "an InterpretedFunction of the same function (cached per kernel); a kernel decorated inside the "
         "block (a package imported lazily) is still a JITFunction, so it runs compiled after the block",
         "never by itself: it is how an already-imported package is interpreted in-process"),
    Shim("libdevice",
         "triton.language.extra.libdevice functions (`rsqrt`, `tanh`, ...) are stubs that return None in the "
         "interpreter (only triton.language and tl.math are patched, `_patch_lang`): liger's RMSNorm, "
         "LayerNorm and GeGLU import `rsqrt` / `tanh` from it",
         "while a kernel runs, names in its module bound to a libdevice stub are bound to numpy-backed "
         "equivalents (tl.math's where it has one)",
         "`_patch_lang` patches triton.language.extra.libdevice"),
)


def install() -> None:
    """Turn the interpret knob on, route launches to the interpreter, keep ``triton.jit`` compiling."""
    _install_knob()
    _install_launch()
    _install_decorate()


def _install_knob() -> None:
    """``knobs.runtime.interpret``: read by ``constexpr_function`` and the autotuner at run time."""
    from triton import knobs

    old = knobs.runtime.interpret
    knobs.runtime.interpret = True
    on_exit(lambda: setattr(knobs.runtime, "interpret", old))


_interpreted: dict[int, Any] = {}


def _interpreted_of(jit_fn: Any) -> Any:
    from triton.runtime.interpreter import InterpretedFunction

    found = _interpreted.get(id(jit_fn))
    if found is None or found[0] is not jit_fn:
        fn = InterpretedFunction(jit_fn.fn, version=jit_fn.version, do_not_specialize=jit_fn.do_not_specialize,
                                 do_not_specialize_on_alignment=jit_fn.do_not_specialize_on_alignment,
                                 debug=jit_fn.debug, noinline=jit_fn.noinline, repr=jit_fn._repr,
                                 launch_metadata=jit_fn.launch_metadata)
        fn.pre_run_hooks = jit_fn.pre_run_hooks
        found = _interpreted[id(jit_fn)] = (jit_fn, fn)
    return found[1]


def _install_launch() -> None:
    from triton.runtime.jit import JITFunction

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        _bind_libdevice(self.fn.__globals__)
        return _interpreted_of(self).run(*args, grid=grid, warmup=warmup, **kwargs)

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:  # a jit function called from an interpreted kernel
        _bind_libdevice(self.fn.__globals__)
        return _interpreted_of(self)(*args, **kwargs)

    set_attr(JITFunction, "run", run)
    set_attr(JITFunction, "__call__", call)


def _install_decorate() -> None:
    """``triton.jit`` inside the block decorates as outside it (the knob is on only for running kernels)."""
    import triton
    import triton.runtime
    from triton import knobs
    from triton.runtime import jit as jit_module

    original = jit_module.jit

    def compiled(make: Callable[[], Any]) -> Any:
        old = knobs.runtime.interpret
        knobs.runtime.interpret = False
        try:
            return make()
        finally:
            knobs.runtime.interpret = old

    def jit(fn: Any = None, **options: Any) -> Any:
        if fn is not None:
            return compiled(lambda: original(fn, **options))
        decorator = original(**options)
        return lambda f: compiled(lambda: decorator(f))

    for module in (triton, triton.runtime, jit_module):
        if getattr(module, "jit", None) is original:
            set_attr(module, "jit", jit)


# ---------------------------------------------------------------- libdevice


_LIBDEVICE = "triton.language.extra.libdevice"


def _libdevice_replacements() -> dict[int, Callable[..., Any]]:
    """libdevice stub -> an interpretable function computing the same (fp32 in, fp32 out, as on CUDA)."""
    import numpy as np
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime import interpreter

    def unary(np_fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def op(x: Any) -> Any:
            x = x if isinstance(x, tl.tensor) else tl.tensor(
                interpreter.TensorHandle(np.array([x], dtype=np.float32), tl.float32), tl.float32)
            data = np_fn(x.handle.data).astype(x.handle.data.dtype)
            return tl.tensor(interpreter.TensorHandle(data, x.handle.dtype.scalar), x.type)

        return op

    table = {"rsqrt": unary(lambda a: 1 / np.sqrt(a)), "tanh": unary(np.tanh), "exp": unary(np.exp),
             "log": unary(np.log), "sqrt": unary(np.sqrt)}
    return {id(getattr(libdevice, name)): fn for name, fn in table.items() if hasattr(libdevice, name)}


_replacements: dict[int, Callable[..., Any]] | None = None
_bound: set[int] = set()


def _bind_libdevice(namespace: dict[str, Any]) -> None:
    """Bind a kernel module's libdevice names to interpretable functions until interpretation ends.

    Once per module and scope (a per-launch bind would be undone by a nested call's exit while
    the outer kernel still runs).
    """
    global _replacements
    if id(namespace) in _bound:
        return
    if _replacements is None:
        _replacements = _libdevice_replacements()
    _bound.add(id(namespace))
    on_exit(lambda: _bound.discard(id(namespace)))
    # by identity, plain functions only: hashing a JITFunction computes its cache key (a source walk)
    for name, value in list(namespace.items()):
        if getattr(value, "__module__", None) == _LIBDEVICE and id(value) in _replacements:
            namespace[name] = _replacements[id(value)]
            on_exit(lambda name=name, value=value: namespace.__setitem__(name, value))
