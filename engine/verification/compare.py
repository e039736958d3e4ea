"""Comparing two results: tolerances per dtype, and the errors of one result against another.

Why its own module: every check (a module, a function, the whole model) judges numbers the
same way, and the tolerances are what a reader of a failure needs to look up.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

#: (atol, rtol) per dtype for kernel-vs-original comparisons (torch.testing's defaults). An
#: element passes within ``atol + rtol * max|reference|``: relative to the tensor's scale, not
#: to the element, because a module's output is often a reduction (an MLP's down projection)
#: over an intermediate a fused kernel rounds once instead of twice; near-zero outputs of such
#: a sum carry the intermediate's rounding in absolute terms.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1.3e-6),
    torch.float64: (1e-7, 1e-7),
    torch.bfloat16: (1e-5, 1.6e-2),
    torch.float16: (1e-5, 1e-3),
}


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def compare(actual: Any, expected: Any) -> tuple[float, float, bool]:
    """``(max abs err, max rel err, within tolerance)`` of two tensors or tuples of tensors."""
    if isinstance(expected, Mapping):  # a ModelOutput: compare its tensor fields (not e.g. a cache object)
        if not isinstance(actual, Mapping) or actual.keys() != expected.keys():
            return float("inf"), float("inf"), False
        keys = [k for k, v in expected.items() if isinstance(v, (torch.Tensor, tuple, list))]
        expected, actual = [expected[k] for k in keys], [actual[k] for k in keys]
    if isinstance(expected, (tuple, list)):
        if not expected:
            return 0.0, 0.0, len(actual) == 0
        results = [compare(a, e) for a, e in zip(actual, expected, strict=True)]
        return max(r[0] for r in results), max(r[1] for r in results), all(r[2] for r in results)
    if not isinstance(expected, torch.Tensor):
        return 0.0, 0.0, actual == expected
    if not isinstance(actual, torch.Tensor) or actual.shape != expected.shape:
        return float("inf"), float("inf"), False
    # A result of another dtype (an fp32 result where the module returns bf16) fails whatever its
    # values; its errors are still measured, so the report shows how far off the numbers are.
    same_dtype = actual.dtype == expected.dtype
    atol, rtol = TOLERANCES.get(expected.dtype, (1e-5, 1e-5))
    a, e = actual.detach().double(), expected.detach().double()
    if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
        same = torch.equal(a.nan_to_num(), e.nan_to_num())
        return (0.0, 0.0, same and same_dtype) if same else (float("inf"), float("inf"), False)
    diff = (a - e).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    max_rel = float((diff / e.abs().clamp_min(1e-12)).max()) if diff.numel() else 0.0
    scale = float(e.abs().max()) if e.numel() else 0.0
    ok = same_dtype and bool((diff <= atol + rtol * scale).all())
    return max_abs, max_rel, ok


def is_exact(result: tuple[float, float, bool]) -> bool:
    """Bit-exact: same dtype and shape, zero difference."""
    return result[2] and result[0] == 0.0


def clone_tensors(value: Any) -> Any:
    """Tensors cloned (nested in tuples, lists and dicts): inputs a kernel may write in place."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, (tuple, list)):
        return type(value)(clone_tensors(v) for v in value)
    if isinstance(value, dict):
        return {k: clone_tensors(v) for k, v in value.items()}
    return value


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floats(v, dtype) for k, v in value.items()}
    return value
