"""Shims ``float_args`` and ``loop_index``: values a compiled kernel sees as tensors, the interpreter as Python.

Why: a compiled kernel receives a float argument as an fp32 scalar and runs ``range`` loops with a
tensor index, so vendor code calls ``.to(...)`` on both; the interpreter hands it a Python
``float`` / ``int`` and the call raises ``AttributeError``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from engine.kernels.triton_interpret._state import Shim, on_exit, set_attr

__all__ = ["SHIMS", "install"]

SHIMS: tuple[Shim, ...] = (
    Shim("float_args",
         "a Python float kernel argument stays a float (triton/runtime/interpreter.py `_implicit_cvt` converts "
         "bool, int and pointers only): `eps.to(tl.float32)` raises AttributeError: 'float' object has no "
         "attribute 'to' (liger RMSNorm, LayerNorm, SiLU-mul, fused linear cross-entropy)",
         "floats become a 1-element fp32 tl.tensor, as a compiled kernel receives them",
         "`triton.runtime.interpreter._implicit_cvt(0.5)` returns a tl.tensor"),
    Shim("loop_index",
         "the interpreter runs a kernel's `for i in range(n)` as a Python loop, so `i` is a Python int where a "
         "compiled kernel's loop index is an int32 tensor: `i_t.to(tl.int64)` raises AttributeError: 'int' "
         "object has no attribute 'to' (fla's chunk kernels, common/chunk_delta_h.py)",
         "a kernel's `for ... in range(...)` yields int32 (int64 past 2**31) 1-element tl.tensors",
         "the interpreter's ASTTransformer rewrites `range` loops (or `_new_range` yields tensors)"),
)


def install() -> None:
    """Float arguments and ``range`` loop indices become tl.tensors, as in a compiled kernel."""
    _install_float_args()
    _install_loop_index()


def _install_float_args() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._implicit_cvt

    def implicit_cvt(arg: Any) -> Any:
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return original(arg)

    set_attr(interpreter, "_implicit_cvt", implicit_cvt)


_LOOP_RANGE = "_engine_interpreted_range"


def _install_loop_index() -> None:
    import ast

    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    def loop_range(*bounds: Any) -> Iterator[Any]:
        for i in range(*(int(b.handle.data.item()) if isinstance(b, tl.tensor) else int(b) for b in bounds)):
            ty, np_ty = (tl.int32, np.int32) if -2**31 <= i < 2**31 else (tl.int64, np.int64)
            yield tl.tensor(interpreter.TensorHandle(np.array([i], dtype=np_ty), ty), ty)

    visit_for = interpreter.ASTTransformer.__dict__.get("visit_For")

    def visit_For(self: Any, node: Any) -> Any:
        node = visit_for(self, node) if visit_for is not None else self.generic_visit(node)
        it = node.iter
        if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "range":
            it.func = ast.copy_location(ast.Name(id=_LOOP_RANGE, ctx=ast.Load()), it.func)
        return node

    set_attr(interpreter, _LOOP_RANGE, loop_range)  # copied into each kernel's globals by _compile_and_exec
    set_attr(interpreter.ASTTransformer, "visit_For", visit_For)
    rewritten = interpreter.InterpretedFunction.rewritten_fn
    before = set(rewritten)
    # rewritten kernels carry the loop rewrite: forget them at the end (a later TRITON_INTERPRET run rewrites anew)
    on_exit(lambda: [rewritten.pop(fn, None) for fn in set(rewritten) - before])
