"""Run vendor Triton kernels (liger, fla) on CPU tensors with Triton's own interpreter, in-process.

Why: on a machine without a GPU, ``verify --device cuda --interpret`` runs the very kernel
code a CUDA plan would run (our arguments, layouts, dtypes, chunk sizes) and judges it with
the usual verifier. Triton's interpreter (``TRITON_INTERPRET=1``) runs most of that code
already; what stops it is a handful of gaps, closed here by named shims. Nothing in this
module is active outside :func:`interpreting` (a context manager): every attribute it
replaces is put back on exit, so a process that never asks for interpretation runs triton
exactly as installed.

Each shim names the gap it closes and how to tell that triton no longer needs it
(:data:`SHIMS`; ``python -m engine.kernels.triton_interpret`` probes each gap and prints
whether the installed triton still has it).

In-process, not a subprocess: ``TRITON_INTERPRET`` is read when a kernel is *decorated*
(``triton.jit`` returns a ``JITFunction`` or an ``InterpretedFunction``), and liger and fla
are imported long before (transformers imports fla). The ``launch`` shim therefore hands a
launch of an already-decorated ``JITFunction`` to an ``InterpretedFunction`` of the same
Python function, which is exactly what the decorator would have built under the variable.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["SHIMS", "Shim", "interpreting", "is_interpreting"]


@dataclass(frozen=True)
class Shim:
    """One interpreter gap: what fails without the shim, what the shim does, how to tell it is obsolete."""

    name: str
    gap: str
    fix: str
    obsolete_when: str


SHIMS: tuple[Shim, ...] = (
    Shim("launch",
         "TRITON_INTERPRET is read when triton.jit decorates a kernel (triton/runtime/jit.py, `jit`): "
         "kernels of a package imported before cannot be interpreted by setting it later",
         "a launch (JITFunction.run) or a nested call (JITFunction.__call__) of a decorated kernel runs "
         "an InterpretedFunction of the same function (cached per kernel); a kernel decorated inside the "
         "block (a package imported lazily) is still a JITFunction, so it runs compiled after the block",
         "never by itself: it is how an already-imported package is interpreted in-process"),
    Shim("float_args",
         "a Python float kernel argument stays a float (triton/runtime/interpreter.py `_implicit_cvt` converts "
         "bool, int and pointers only): `eps.to(tl.float32)` raises AttributeError: 'float' object has no "
         "attribute 'to' (liger RMSNorm, LayerNorm, SiLU-mul, fused linear cross-entropy)",
         "floats become a 1-element fp32 tl.tensor, as a compiled kernel receives them",
         "`triton.runtime.interpreter._implicit_cvt(0.5)` returns a tl.tensor"),
    Shim("libdevice",
         "triton.language.extra.libdevice functions (`rsqrt`, `tanh`, ...) are stubs that return None in the "
         "interpreter (only triton.language and tl.math are patched, `_patch_lang`): liger's RMSNorm, "
         "LayerNorm and GeGLU import `rsqrt` / `tanh` from it",
         "while a kernel runs, names in its module bound to a libdevice stub are bound to numpy-backed "
         "equivalents (tl.math's where it has one)",
         "`_patch_lang` patches triton.language.extra.libdevice"),
    Shim("bf16",
         "the interpreter stores bfloat16 as uint16 (numpy has no bf16): (1) its binary, unary, ternary, fma and dot "
         "ops run numpy on that storage, so bf16 * bf16 multiplies bit patterns as integers (liger's SiLU-mul "
         "`silu(a).cast(b.dtype) * b`: NaN / inf where a GPU computes numbers); (2) its fp32 -> bf16 cast "
         "(`_convert_float`) truncates by default and its 'rtne' rounds half up without carrying into the "
         "exponent, where a GPU's `.to(tl.bfloat16)` rounds to nearest even",
         "arithmetic (and tl.dot) on bf16 operands widens them to fp32 and rounds a bf16 result once; fp32/fp64 -> bf16 "
         "casts round to nearest even (torch's conversion), an explicit 'rtz' still truncates",
         "`InterpreterBuilder.binary_op` multiplies two bf16 handles' values, and `cast_impl` of "
         "fp32 1.00390625 + 2**-9 to bf16 gives 1.0078125"),
    Shim("tf32",
         "tl.dot on fp32 operands defaults to input_precision 'tf32' (NVIDIA tensor cores keep 10 mantissa bits "
         "of each operand), but the interpreter's `create_dot` ignores input_precision and multiplies in full "
         "fp32: an fp32 kernel would look more exact interpreted than on the GPU (fla's chunk kernels)",
         "for input_precision tf32, fp32 operands are rounded to tf32 (10 mantissa bits, to nearest, ties away "
         "from zero as PTX `cvt.rna.tf32.f32`) before the product; 'ieee' and 'tf32x3' stay full fp32",
         "`InterpreterBuilder.create_dot` reads input_precision"),
    Shim("loop_index",
         "the interpreter runs a kernel's `for i in range(n)` as a Python loop, so `i` is a Python int where a "
         "compiled kernel's loop index is an int32 tensor: `i_t.to(tl.int64)` raises AttributeError: 'int' "
         "object has no attribute 'to' (fla's chunk kernels, common/chunk_delta_h.py)",
         "a kernel's `for ... in range(...)` yields int32 (int64 past 2**31) 1-element tl.tensors",
         "the interpreter's ASTTransformer rewrites `range` loops (or `_new_range` yields tensors)"),
    Shim("autotune",
         "an autotuned kernel (fla's chunk kernels) benchmarks its configs with the driver's benchmarker, "
         "which needs a GPU driver, and one with cache_results (fla's l2norm) keys its disk cache by the "
         "driver's target: RuntimeError: 0 active drivers ([]). There should only be one.",
         "every config times the same, so the first config runs (timing means nothing in the interpreter); "
         "no disk cache",
         "Autotuner.do_bench works under TRITON_INTERPRET on a machine without a GPU driver"),
)

_lock = threading.RLock()
_depth = 0
_restore: list[Callable[[], None]] = []


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
                _deactivate()


def _activate() -> None:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        from engine.errors import MissingDependency

        raise MissingDependency("interpreting Triton kernels needs triton (pip install triton; the cuda and fla "
                                f"extras install it): import failed: {exc}") from exc
    try:
        _install_knob()
        _install_launch()
        _install_decorate()
        _install_float_args()
        _install_autotune()
        _install_bf16()
        _install_loop_index()
    except BaseException:
        _deactivate()
        raise


def _deactivate() -> None:
    while _restore:
        _restore.pop()()


def _set(obj: Any, name: str, value: Any) -> None:
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


def _install_knob() -> None:
    """``knobs.runtime.interpret``: read by ``constexpr_function`` and the autotuner at run time."""
    from triton import knobs

    old = knobs.runtime.interpret
    knobs.runtime.interpret = True
    _restore.append(lambda: setattr(knobs.runtime, "interpret", old))


# ---------------------------------------------------------------- launch


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

    _set(JITFunction, "run", run)
    _set(JITFunction, "__call__", call)


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
            _set(module, "jit", jit)


# ---------------------------------------------------------------- float_args


def _install_float_args() -> None:
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._implicit_cvt

    def implicit_cvt(arg: Any) -> Any:
        if isinstance(arg, float):
            return tl.tensor(interpreter.TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return original(arg)

    _set(interpreter, "_implicit_cvt", implicit_cvt)


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
    """Bind a kernel module's libdevice names to interpretable functions until :func:`interpreting` ends.

    Once per module and scope (a per-launch bind would be undone by a nested call's exit while
    the outer kernel still runs).
    """
    global _replacements
    if id(namespace) in _bound:
        return
    if _replacements is None:
        _replacements = _libdevice_replacements()
    _bound.add(id(namespace))
    _restore.append(lambda: _bound.discard(id(namespace)))
    # by identity, plain functions only: hashing a JITFunction computes its cache key (a source walk)
    for name, value in list(namespace.items()):
        if getattr(value, "__module__", None) == _LIBDEVICE and id(value) in _replacements:
            namespace[name] = _replacements[id(value)]
            _restore.append(lambda name=name, value=value: namespace.__setitem__(name, value))


# ---------------------------------------------------------------- bf16


def _install_bf16() -> None:
    import numpy as np
    import torch
    import triton.language as tl
    from triton._C.libtriton import ir as _ir
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def to_bf16(h: Any) -> Any:  # round to nearest even, NaN kept NaN
        data = np.ascontiguousarray(h.data)
        bits = torch.from_numpy(data).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return TensorHandle(bits.reshape(data.shape), tl.bfloat16)

    cast_impl, fp_to_fp = InterpreterBuilder.cast_impl, InterpreterBuilder.create_fp_to_fp

    def cast(self: Any, src: Any, dst_type: Any) -> Any:
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar in (tl.float32, tl.float64):
            return to_bf16(src)
        return cast_impl(self, src, dst_type)

    def create_fp_to_fp(self: Any, src: Any, dst_type: Any, rounding_mode: Any) -> Any:
        if (dst_type.scalar == tl.bfloat16 and src.dtype.scalar in (tl.float32, tl.float64)
                and rounding_mode != _ir.ROUNDING_MODE.RTZ):
            return to_bf16(src)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    _set(InterpreterBuilder, "cast_impl", cast)
    _set(InterpreterBuilder, "create_fp_to_fp", create_fp_to_fp)

    def wide(builder: Any, h: Any) -> Any:
        return builder.cast_impl(h, tl.float32) if h.dtype.scalar == tl.bfloat16 else h

    def narrow(builder: Any, h: Any, was_bf16: bool) -> Any:
        return builder.cast_impl(h, tl.bfloat16) if was_bf16 and h.dtype.scalar == tl.float32 else h

    binary, unary, ternary, fma = (InterpreterBuilder.binary_op, InterpreterBuilder.unary_op,
                                   InterpreterBuilder.ternary_op, InterpreterBuilder.create_fma)
    dot = InterpreterBuilder.create_dot

    def tf32(h: Any) -> Any:
        bits = np.ascontiguousarray(h.data, dtype=np.float32).view(np.uint32)
        rounded = ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)  # to nearest, ties away
        return TensorHandle(np.where(np.isfinite(h.data), rounded, h.data).astype(np.float32), tl.float32)

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        if (input_precision == _ir.INPUT_PRECISION.TF32 and a.dtype.scalar == tl.float32
                and b.dtype.scalar == tl.float32):
            return dot(self, tf32(a), tf32(b), d, input_precision, max_num_imprecise_acc)
        if tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar, d.dtype.scalar):
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = dot(self, wide(self, a), wide(self, b), wide(self, d), input_precision, max_num_imprecise_acc)
        return narrow(self, out, d.dtype.scalar == tl.bfloat16)  # bf16 x bf16 accumulates in fp32 (an fp32 d)

    def binary_op(self: Any, lhs: Any, rhs: Any, op: Any) -> Any:
        bf16 = tl.bfloat16 in (lhs.dtype.scalar, rhs.dtype.scalar)
        if not bf16 or op in (np.bitwise_and, np.bitwise_or, np.bitwise_xor):
            return binary(self, lhs, rhs, op)
        return narrow(self, binary(self, wide(self, lhs), wide(self, rhs), op), True)

    def unary_op(self: Any, arg: Any, op: Any) -> Any:
        if arg.dtype.scalar != tl.bfloat16:
            return unary(self, arg, op)
        return narrow(self, unary(self, wide(self, arg), op), True)

    def ternary_op(self: Any, a: Any, b: Any, c: Any, op: Any) -> Any:
        if op is np.where or tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar, c.dtype.scalar):
            return ternary(self, a, b, c, op)  # a select moves bit patterns: right as it is
        return narrow(self, ternary(self, wide(self, a), wide(self, b), wide(self, c), op), True)

    def create_fma(self: Any, x: Any, y: Any, z: Any) -> Any:
        if tl.bfloat16 not in (x.dtype.scalar, y.dtype.scalar, z.dtype.scalar):
            return fma(self, x, y, z)
        return narrow(self, fma(self, wide(self, x), wide(self, y), wide(self, z)), True)

    _set(InterpreterBuilder, "binary_op", binary_op)
    _set(InterpreterBuilder, "unary_op", unary_op)
    _set(InterpreterBuilder, "ternary_op", ternary_op)
    _set(InterpreterBuilder, "create_fma", create_fma)
    _set(InterpreterBuilder, "create_dot", create_dot)


# ---------------------------------------------------------------- loop_index

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

    _set(interpreter, _LOOP_RANGE, loop_range)  # copied into each kernel's globals by _compile_and_exec
    _set(interpreter.ASTTransformer, "visit_For", visit_For)
    rewritten = interpreter.InterpretedFunction.rewritten_fn
    before = set(rewritten)
    # rewritten kernels carry the loop rewrite: forget them at the end (a later TRITON_INTERPRET run rewrites anew)
    _restore.append(lambda: [rewritten.pop(fn, None) for fn in set(rewritten) - before])


# ---------------------------------------------------------------- autotune


def _install_autotune() -> None:
    from triton.runtime.autotuner import Autotuner

    def do_bench(self: Any) -> Callable[..., list[float]]:
        def bench(kernel_call: Callable[[], None], quantiles: Any = None) -> list[float]:
            return [1.0, 1.0, 1.0]  # not run: the interpreter's time says nothing about a GPU's

        return bench

    def check_disk_cache(self: Any, tuning_key: Any, configs: Any, bench_fn: Callable[[], None]) -> bool:
        bench_fn()  # no disk cache: its key asks the driver for the GPU target
        return False

    _set(Autotuner, "do_bench", property(do_bench))
    _set(Autotuner, "check_disk_cache", check_disk_cache)
