"""``compiled``: an op's torch reference through ``torch.compile`` (inductor), for the CPU.

Why: on a CPU, eager RMSNorm makes one pass over memory per elementwise step (upcast, square,
mean, rsqrt, multiply, cast, multiply); inductor fuses them into one C++ loop nest, several
times faster (see docs/performance.md). The math is the reference's, so the op's semantics are
defined once; the result is not bit-identical (inductor reduces in another order: within one
ulp of bf16, ~1e-7 in fp32), which is why the bit-exact family tests run with compiled kernels
disabled (``PATCH_ENGINE_COMPILE=0``) and tests/test_compiled.py checks them within tolerance.

Which ops: only those listed in :data:`COMPILED_OPS`, the ones where the benchmark
(benchmarks/run.py) shows a win. ``auto`` on CPU tries ``compiled`` first (AUTO_ORDER), so
this table is the data that decides what ``auto`` picks; an op not in it gets ``torch``.
Where, within an op: :func:`rule` (``engine/_data/compiled_rows.yaml``, measured) says from
how many rows, per dtype and mode, a call runs compiled; every other call runs the torch
reference eagerly, so ``auto`` never pays a compiled call's fixed cost where it does not win.

Compilation is lazy (first call) and cached: one kernel per (op, settings that change the
math), shared by every module and model in the process, and inside it one compiled function
per *shape class* (dtype, rank, which sizes are 0 or 1, grad mode: what dynamo specializes a
``dynamic=True`` compile on), each with its own code object. Why: dynamo recompiles one code
object at most ``recompile_limit`` (8) times and then runs it eagerly without a word; one
function serving every norm shape, prefill and decode, fp32 and bf16, inference and training
hit that limit in one session on Gemma 3 (issue 17). Norms and gated products act on the last
dimension, so they are compiled on their input seen as ``[rows, last dim]`` (:func:`by_rows`):
every hidden and per-head shape, batch and length is one class per dtype and grad mode.
Compiles use ``fullgraph=True``, so a limit still hit raises inside dynamo and we warn.

No C++ compiler: detected up front by the provider's requirement check, so ``auto`` passes
over ``compiled`` with that reason in the plan and picks ``torch``. If compiling still fails at
the first call, the kernel warns once and runs the torch reference from then on.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import types
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import MissingDependency
from engine.kernels.compiled_rule import RULE_FILE, only_where, rule, rule_text
from engine.kernels.inductor_env import import_cpp_extension_quietly
from engine.kernels.registry import KernelProvider, register
from engine.runtime.control_flow import not_a_failure
from engine.schema import Device

__all__ = [
    "COMPILED_OPS",
    "ENV_SWITCH",
    "RULE_FILE",
    "CompilerRequirement",
    "clear_cache",
    "compiled_from",
    "compiled_kernel",
    "find_cxx",
    "only_where",
    "rule",
    "rule_text",
]

#: Set to ``0`` to disable compiled kernels (``auto`` then picks ``torch``, bit-exact with transformers).
ENV_SWITCH = "PATCH_ENGINE_COMPILE"


@functools.lru_cache(maxsize=1)
def find_cxx() -> str | None:
    """The C++ compiler inductor would use, or None. Looked up once per process."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        name = get_cpp_compiler()
    except Exception:  # inductor raises when it finds none
        return None
    return shutil.which(name) if name else None


@dataclass(frozen=True)
class CompilerRequirement:
    """A requirement like :class:`~engine.kernels.registry.Dependency`, for the C++ compiler."""

    module: str = "torch._inductor"
    package: str = "a C++ compiler"
    extra: str = "-"

    def check(self) -> None:
        if os.environ.get(ENV_SWITCH, "1").strip() == "0":
            raise MissingDependency(f"compiled kernels are disabled by {ENV_SWITCH}=0")
        if find_cxx() is None:
            raise MissingDependency(
                "torch.compile (inductor) needs a C++ compiler for CPU kernels and none was found "
                "(set CXX or install g++/clang++), or choose kernel: torch"
            )



#: When not None, every call of at least this many rows runs compiled, whatever the rule says
#: (:func:`compiled_from`: tests of the compiled code, and benchmarks that measure it).
FORCED_ROWS: int | None = None


@contextlib.contextmanager
def compiled_from(rows: int) -> Iterator[None]:
    """Run every call of at least ``rows`` rows compiled while the block runs (tests, benchmarks)."""
    global FORCED_ROWS
    before, FORCED_ROWS = FORCED_ROWS, rows
    try:
        yield
    finally:
        FORCED_ROWS = before


def _sizes(shape: torch.Size) -> tuple[int, ...]:
    """A shape as dynamo's ``dynamic=True`` sees it: 0 and 1 are specialized, any larger size is one symbol."""
    return tuple(min(2, s) for s in shape)


def _shape_class(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What dynamo specializes a ``dynamic=True`` compile on, as a hashable key.

    Per tensor: type, dtype, device, requires_grad, contiguity, rank and which sizes are 0 or 1
    (never symbolic); a parameter's whole shape (dynamo keeps parameter shapes static, and a
    norm's input width with them); for a view, the same of its base (dynamo guards the base a
    view was taken from: a ``[rows, width]`` view of a batch-1 ``[1, T, width]`` tensor is
    another class than one of a batch-2 tensor). Then the global state it guards (grad mode,
    inference mode, CPU autocast). A compiled function that only ever sees one class compiles
    once, so dynamo's per-code recompile limit (8) cannot be reached by the mix a session brings
    (norm shapes, prefill and decode lengths, fp32 and bf16, inference and training).
    """
    key: list[Any] = [torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu")]
    for a in args:
        if isinstance(a, torch.Tensor):
            base = a._base
            key.append((type(a), a.dtype, a.device, a.requires_grad, a.is_contiguous(),
                        tuple(a.shape) if isinstance(a, torch.nn.Parameter) else _sizes(a.shape),
                        None if base is None else _sizes(base.shape)))
        else:
            key.append(type(a))
    return tuple(key)


def _compile(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``torch.compile`` of a copy of ``fn`` with its own code object named ``name``.

    Own code object: dynamo caches and limits recompiles per code object. ``fullgraph``: our
    functions are pure tensor math with no graph break, and it turns dynamo's silent eager
    fallback at the recompile limit into an exception (``FailOnRecompileLimitHit``) that
    :class:`_CompiledKernel` reports.
    """
    import_cpp_extension_quietly()
    return torch.compile(_own_code(fn, name), dynamic=True, fullgraph=True)


class _CompiledKernel:
    """The compiled reference, one compiled function per shape class (:func:`_shape_class`).

    Compiling is lazy (the first call of a class). A failed compile (no working C++ compiler,
    an inductor error) warns once and runs the reference from then on; a class that still hits
    dynamo's recompile limit warns once, naming the function, and runs that class eagerly,
    where torch alone would fall back without a word.
    """

    __slots__ = ("compile", "failed", "functions", "label", "reference", "warned")

    def __init__(self, reference: Callable[..., Any], label: str,
                 compile: Callable[[Callable[..., Any], str], Callable[..., Any]] = _compile):
        self.reference, self.label, self.compile = reference, label, compile
        self.functions: dict[tuple[Any, ...], Callable[..., Any] | None] = {}  # None: runs eagerly (limit hit)
        self.failed = self.warned = False

    def __call__(self, *args: Any) -> Any:
        if self.failed or torch.compiler.is_compiling():  # inside a user's torch.compile: it fuses the reference
            return self.reference(*args)
        key = _shape_class(args)
        fn = self.functions.get(key, _MISSING)
        if fn is _MISSING:
            fn = self.functions[key] = self.compile(self.reference, f"compiled_{self.label}_{len(self.functions)}")
        if fn is None:
            return self.reference(*args)
        try:
            if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad for a in args):
                return _Trainable.apply(self, fn, *args)
            return fn(*args)
        except not_a_failure():  # a checkpoint's early stop, out of memory: not the compiled kernel's failure
            raise
        except Exception as exc:
            return self._fall_back(key, exc, args)

    def _fall_back(self, key: tuple[Any, ...], exc: Exception, args: tuple[Any, ...]) -> Any:
        result = self.reference(*args)  # a genuine input error raises here, from the reference
        if type(exc).__name__ == "FailOnRecompileLimitHit":
            self.functions[key] = None
            what = (f"torch.compile of {self.label} hit dynamo's recompile limit for inputs of class {key}; "
                    "that class runs the torch reference (eager, slower) from now on. Please report it: "
                    "engine/kernels/compiled.py keys compiles so that this should not happen")
        else:
            self.failed = True
            what = (f"torch.compile of {self.label} failed ({type(exc).__name__}: {str(exc)[:200]}); "
                    "using the torch reference from now on")
        if not self.warned or self.failed:
            self.warned = True
            warnings.warn(what, RuntimeWarning, stacklevel=3)
        return result

    def backward_failed(self, exc: Exception) -> None:
        """The compiled backward failed (inductor compiles it at the first backward): the reference from now on."""
        self.failed = True
        warnings.warn(f"torch.compile of {self.label}'s backward failed ({type(exc).__name__}: {str(exc)[:200]}); "
                      "this gradient and every later call use the torch reference", RuntimeWarning, stacklevel=2)

    def compiles(self) -> dict[tuple[Any, ...], int]:
        """How many times dynamo compiled each class's function (1 each when nothing recompiled)."""
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list

        out = {}
        for key, fn in self.functions.items():
            code = getattr(getattr(fn, "_torchdynamo_orig_callable", None), "__code__", None)
            out[key] = len(_debug_get_cache_entry_list(code)) if code is not None else 0
        return out


_SAVED = object()  # marks a tensor argument, kept by save_for_backward


class _Trainable(torch.autograd.Function):
    """A compiled call under autograd, whose backward also works where the compiled one cannot.

    Why: the backward AOTAutograd compiles runs once and only once. Inductor donates its saved
    buffers to it (``backward(retain_graph=True)`` raises "compiled with non-empty donated
    buffers"; turning donation off at compile time does not lift that check), and it has no
    double backward (``create_graph=True``). The eager forward supports both, so a model
    patched with compiled kernels must too: several losses on one graph, gradient penalties.

    So the compiled function runs inside this node, recording its own graph. A plain
    backward (the training step) runs the compiled backward through that graph. A backward
    that keeps the graph (``retain_graph=True``) or builds one (``create_graph=True``)
    differentiates the op's torch reference, recomputed from the saved inputs, instead:
    the same math (within the compiled kernel's rounding), differentiable again, and it
    leaves the compiled graph unused for a last plain backward. Cost: one more autograd node
    per compiled call in training; nothing in inference.

    Each graph inside the node starts at the node's inputs, never above them: the compiled one
    at detached leaves, the recomputed one at a view of each input. Why: one input may be an
    ancestor of another (an MoE's experts take the hidden states and the routing weights the
    router computed from them), and a gradient taken with respect to the inputs themselves is
    then the total derivative: it ran the router's backward inside this node (freeing its saved
    tensors: the step's own backward then raised "Trying to backward through the graph a second
    time") and would have counted the router's path twice.

    Inductor compiles the backward lazily, at the first backward: a compile that fails there (as
    torch 2.14.1's did on the MoE experts) would end the user's step, where a failed forward
    compile falls back. So it falls back the same way: this gradient from the reference, and
    the kernel runs the reference from then on, with a warning.
    """

    @staticmethod
    def forward(ctx: Any, kernel: _CompiledKernel, fn: Callable[..., Any], *args: Any) -> Any:
        leaves = tuple(a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in args)
        with torch.enable_grad():
            out = fn(*leaves)
        ctx.kernel, ctx.reference, ctx.out, ctx.leaves = kernel, kernel.reference, out, leaves
        ctx.args = tuple(_SAVED if isinstance(a, torch.Tensor) else a for a in args)
        ctx.save_for_backward(*(a for a in args if isinstance(a, torch.Tensor)))
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        saved = iter(ctx.saved_tensors)
        args = [next(saved) if a is _SAVED else a for a in ctx.args]
        wanted = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        create = torch.is_grad_enabled()
        grads = None
        if not (create or ctx.out is None or torch._C._autograd._get_current_graph_task_keep_graph()):
            out, ctx.out = ctx.out, None  # its saved buffers are spent by this backward
            leaves, ctx.leaves = ctx.leaves, None
            try:
                grads = torch.autograd.grad(out, [leaves[i] for i in wanted], grad, allow_unused=True)
            except not_a_failure():
                raise
            except Exception as exc:
                ctx.kernel.backward_failed(exc)
        if grads is None:
            with torch.enable_grad():  # views: differentiable back to the inputs (double backward), no path between them
                args = [a.view_as(a) if i in wanted else a for i, a in enumerate(args)]
                out = ctx.reference(*args)
            grads = torch.autograd.grad(out, [args[i] for i in wanted], grad, create_graph=create, allow_unused=True)
        result: list[Any] = [None] * (2 + len(args))
        for i, g in zip(wanted, grads, strict=True):
            result[2 + i] = g
        return tuple(result)


_MISSING = object()
_CACHE: dict[tuple[Any, ...], _CompiledKernel] = {}


def _own_code(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A copy of ``fn`` with its own code object (dynamo caches and limits recompiles per code)."""
    code = fn.__code__.replace(co_name=name)  # type: ignore[attr-defined]
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)  # type: ignore[attr-defined]


def compiled_kernel(key: tuple[Any, ...], reference: Callable[..., Any]) -> _CompiledKernel:
    """The compiled ``reference`` for ``key`` (op and settings), built once per process."""
    kernel = _CACHE.get(key)
    if kernel is None:
        kernel = _CACHE[key] = _CompiledKernel(reference, "_".join(str(getattr(k, "value", k)) for k in key))
    return kernel


def kernels() -> dict[tuple[Any, ...], _CompiledKernel]:
    """Every compiled kernel built in this process, by (op, settings): what tests and benchmarks inspect."""
    return dict(_CACHE)


def clear_cache() -> None:
    """Forget every compiled kernel (tests; after changing inductor settings)."""
    _CACHE.clear()


def by_rows(kernel: _CompiledKernel, flat: int, op: str) -> Callable[..., Any]:
    """``kernel`` on the first ``flat`` arguments seen as 2-D ``[rows, last dim]``, where :func:`rule` says so.

    For ops that act on the last dimension alone (a norm, an elementwise product): flattening
    makes every shape (hidden and per-head norms, batch and sequence of any length) one rank-2
    class for the compiler, so one compile serves them all. A call runs the reference as it
    is where the rule for its dtype and mode does not reach its row count, and for inputs of
    different shapes (a broadcast). Training: gradients on and an argument that requires them.
    """
    reference = kernel.reference
    thresholds = rule().get(op, {})

    def run(*args: Any) -> Any:
        x = args[0]
        if torch.compiler.is_compiling():  # inside a user's torch.compile: it fuses the reference itself
            return reference(*args)
        if FORCED_ROWS is None:  # the rule; its common answer (the reference) first, at a dict lookup's cost
            least = thresholds.get((x.dtype, torch.is_grad_enabled() and (x.requires_grad or args[1].requires_grad)))
            if least is None:
                return reference(*args)
        else:
            least = FORCED_ROWS
        shape = x.shape
        last = shape[-1] if shape else 0
        rows = x.numel() // last if last else 0
        if rows < least or any(a.shape != shape for a in args[1:flat]):
            return reference(*args)
        out = kernel(*(a.reshape(rows, last) for a in args[:flat]), *args[flat:])
        return out.view(shape)

    run.kernel = kernel  # type: ignore[attr-defined]
    return run


def _build_rms_norm(patch: Any) -> Callable[..., Any]:
    from engine.ops.rms_norm import rms_norm_reference

    scale, cast, precision = patch.scale, patch.cast, patch.precision

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_reference(x, weight, eps, scale=scale, cast=cast, precision=precision)

    return by_rows(compiled_kernel(("rms_norm", scale, cast, precision), rms_norm), flat=1, op="rms_norm")


def _build_swiglu(patch: Any) -> Callable[..., Any]:
    from engine.ops.swiglu import silu_mul_reference

    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return silu_mul_reference(gate, up)

    return by_rows(compiled_kernel(("swiglu",), silu_mul), flat=2, op="swiglu")


def _build_geglu(patch: Any) -> Callable[..., Any]:
    from engine.ops.geglu import gelu_mul_reference

    approximate = patch.approximate.value if patch is not None else "tanh"

    def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return gelu_mul_reference(gate, up, approximate)

    return by_rows(compiled_kernel(("geglu", approximate), gelu_mul), flat=2, op="geglu")


def _build_moe_experts(patch: Any) -> Callable[..., Any]:
    """The grouped experts through inductor in bf16; other dtypes run them uncompiled.

    Why bf16 only: torch's ``grouped_mm`` has a CPU kernel for fp32 but its meta function (what
    tracing runs) accepts bf16 only, so fp32 cannot compile; and bf16 is where inductor wins,
    fusing the routing gathers, the gate and the per-token sums around the two grouped
    matmuls (benchmarks/moe.py, Qwen3-30B-A3B layer, forward + backward: 1.05x at 512 tokens,
    1.26x at 2048, over the uncompiled grouped path; outputs and gradients as close to fp32
    as it, at bf16 rounding).
    """
    from engine.kernels.moe import build_grouped_kernel

    grouped = build_grouped_kernel(patch)  # positional arguments: the op's kernel signature
    compiled = compiled_kernel(("moe_experts", patch.layout, patch.transposed, patch.activation), grouped)

    def experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: Any = None, down_bias: Any = None,
                alpha: Any = None, limit: Any = None) -> torch.Tensor:
        run = compiled if hidden_states.dtype == torch.bfloat16 and gate_up.dtype == torch.bfloat16 else grouped
        return run(hidden_states, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias, alpha, limit)

    return experts


#: The ops ``compiled`` is registered for: where benchmarks/run.py measured it faster than eager
#: on CPU (rms_norm: several times in bf16; silu*up and gelu*up: fused into one pass). rope,
#: layer_norm (F.layer_norm is already one fused ATen kernel) and fused_linear_cross_entropy are
#: absent: not measured faster, so ``auto`` keeps ``torch`` for them. moe_experts: benchmarks/moe.py
#: (bf16, over the uncompiled grouped path; fp32 runs that path).
COMPILED_OPS: dict[str, Callable[[Any], Callable[..., Any]]] = {
    "rms_norm": _build_rms_norm,
    "swiglu": _build_swiglu,
    "geglu": _build_geglu,
    "moe_experts": _build_moe_experts,
}

def _MOE_NOTE() -> str:
    return "compiled in bfloat16 (benchmarks/moe.py), the grouped path uncompiled in other dtypes"


for _op, _build in COMPILED_OPS.items():
    register(
        KernelProvider(
            name="compiled",
            op=_op,
            # moe_experts: measured on CPU only (on CUDA inductor would template grouped_mm itself)
            devices=frozenset({Device.cpu} if _op == "moe_experts" else {Device.cpu, Device.cuda}),
            build=_build,
            requires=(CompilerRequirement(),),  # type: ignore[arg-type]
            has_backward=True,
            compile_safe=True,
            description="torch reference through torch.compile (inductor); needs a C++ compiler on CPU",
            rule_note=_MOE_NOTE if _op == "moe_experts" else functools.partial(rule_text, _op),
        )
    )
