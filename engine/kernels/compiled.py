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

Compilation is lazy (first call) and cached per specialization: one compiled function per
(op, settings that change the math), shared by every module and model in the process, with
``dynamic=True`` so a new sequence length does not recompile. Each specialization gets its own
code object so dynamo's per-code recompile limit is not shared between them.

No C++ compiler: detected up front by the provider's requirement check, so ``auto`` passes
over ``compiled`` with that reason in the plan and picks ``torch``. If compiling still fails at
the first call, the kernel warns once and runs the torch reference from then on.
"""

from __future__ import annotations

import functools
import os
import shutil
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import MissingDependency
from engine.kernels.registry import KernelProvider, register
from engine.schema import Device

__all__ = ["COMPILED_OPS", "ENV_SWITCH", "CompilerRequirement", "clear_cache", "compiled_kernel", "find_cxx"]

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


class _CompiledKernel:
    """Calls the compiled function; on a compile failure, warns once and uses the reference."""

    __slots__ = ("compiled", "failed", "label", "reference")

    def __init__(self, compiled: Callable[..., Any], reference: Callable[..., Any], label: str):
        self.compiled, self.reference, self.label, self.failed = compiled, reference, label, False

    def __call__(self, *args: Any) -> Any:
        if self.failed:
            return self.reference(*args)
        try:
            return self.compiled(*args)
        except Exception as exc:
            result = self.reference(*args)  # a genuine input error raises here, from the reference
            self.failed = True
            warnings.warn(
                f"torch.compile of {self.label} failed ({type(exc).__name__}: {str(exc)[:200]}); "
                "using the torch reference from now on",
                RuntimeWarning,
                stacklevel=2,
            )
            return result


_CACHE: dict[tuple[Any, ...], _CompiledKernel] = {}


def _own_code(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """A copy of ``fn`` with its own code object (dynamo caches and limits recompiles per code)."""
    code = fn.__code__.replace(co_name=name)  # type: ignore[attr-defined]
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)  # type: ignore[attr-defined]


def compiled_kernel(key: tuple[Any, ...], reference: Callable[..., Any]) -> _CompiledKernel:
    """The compiled ``reference`` for ``key`` (op and settings), built once per process."""
    kernel = _CACHE.get(key)
    if kernel is None:
        label = "_".join(str(getattr(k, "value", k)) for k in key)
        target = _own_code(reference, f"compiled_{label}")
        kernel = _CompiledKernel(torch.compile(target, dynamic=True), reference, label)
        _CACHE[key] = kernel
    return kernel


def clear_cache() -> None:
    """Forget every compiled kernel (tests; after changing inductor settings)."""
    _CACHE.clear()


def _build_rms_norm(patch: Any) -> Callable[..., Any]:
    from engine.ops.rms_norm import rms_norm_reference

    scale, cast, precision = patch.scale, patch.cast, patch.precision

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_reference(x, weight, eps, scale=scale, cast=cast, precision=precision)

    return compiled_kernel(("rms_norm", scale, cast, precision), rms_norm)


def _build_swiglu(patch: Any) -> Callable[..., Any]:
    from engine.ops.swiglu import silu_mul_reference

    def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return silu_mul_reference(gate, up)

    return compiled_kernel(("swiglu",), silu_mul)


def _build_geglu(patch: Any) -> Callable[..., Any]:
    from engine.ops.geglu import gelu_mul_reference

    approximate = patch.approximate.value if patch is not None else "tanh"

    def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return gelu_mul_reference(gate, up, approximate)

    return compiled_kernel(("geglu", approximate), gelu_mul)


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
        )
    )
