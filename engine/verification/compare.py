"""Comparing two results: their differences, and the judge that says whether a difference is a bug.

Why its own module: every check (a module, a function, the whole model) judges numbers the
same way: bit-equal, or within ``k`` times the original's own rounding error (:func:`judge`,
:data:`NOISE_FACTOR`, :data:`FLOOR_ULPS`). :data:`TOLERANCES` are fixed per-dtype tolerances
for callers that compare two kernels directly (tests, the scaffold's bit-exact search).
"""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Iterable, Mapping
from typing import Any

import torch

#: (atol, rtol) per dtype for direct comparisons (``compare(...)[2]``; verification judges kernels
#: and the model with :func:`judge` instead). An
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
    a, e = actual.detach().reshape(-1), expected.detach().reshape(-1)
    found = _differences(a, e)
    if found is None:  # a NaN or an infinity somewhere: equal where both are the same non-finite values
        same = all(torch.equal(_chunk(a, s, a.device).nan_to_num(), _chunk(e, s, a.device).nan_to_num())
                   for s in range(0, e.numel(), _CHUNK))
        return (0.0, 0.0, same and same_dtype) if same else (float("inf"), float("inf"), False)
    max_abs, max_rel, scale = found
    ok = same_dtype and max_abs <= atol + rtol * scale  # every |a - e| within it iff the largest is
    return max_abs, max_rel, ok


def _differences(a: torch.Tensor, e: torch.Tensor) -> tuple[float, float, float] | None:
    """``(max |a - e|, max |a - e| / |e|, max |e|)`` of two flat tensors, or None if either holds a non-finite value.

    Why not in fp64: a whole-model check compares every parameter gradient (the model's size
    again) and this ran at ~9 passes over fp64 copies, 0.7 of a training step's time on
    SmolLM2. The difference of two fp32 (or bf16, fp16 widened to fp32) numbers is exact when
    they are close (Sterbenz) and otherwise rounded by 2^-24 of itself, nothing a judgement
    at the original's rounding error can see; zero exactly when they are equal. fp64 inputs
    stay fp64.
    """
    wide = torch.float64 if torch.float64 in (a.dtype, e.dtype) else torch.float32
    max_abs = max_rel = scale = 0.0
    for start in range(0, e.numel(), _CHUNK):  # a chunk at a time: no full-size temporaries
        x = a[start:start + _CHUNK].to(dtype=wide)
        y = e[start:start + _CHUNK].to(device=a.device, dtype=wide)
        diff = torch.sub(x, y).abs_()
        y = y.abs()  # a new tensor: the in-place steps below never touch the caller's
        chunk_abs, chunk_scale = float(diff.max()), float(y.max())
        if not (math.isfinite(chunk_abs) and math.isfinite(chunk_scale)):
            return None  # NaN - NaN, inf - inf, or an overflow of the difference: the caller decides
        max_abs, scale = max(max_abs, chunk_abs), max(scale, chunk_scale)
        max_rel = max(max_rel, float(diff.div_(y.clamp_min_(1e-12)).max()))
    return max_abs, max_rel, scale


def is_exact(result: tuple[float, float, bool]) -> bool:
    """Bit-exact: same dtype and shape, zero difference."""
    return result[2] and result[0] == 0.0


def clone_tensors(value: Any) -> Any:
    """Tensors cloned (nested in tuples, lists and dicts): inputs a kernel may write in place.

    A transformers ``Cache`` is copied whole: an attention appends its keys to the one it is given, so a
    module run twice on one recorded cache would see its own keys twice (48 keys for 16 queries)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if is_cache(value):
        return copy_cache(value)
    if isinstance(value, (tuple, list)):
        return type(value)(clone_tensors(v) for v in value)
    if isinstance(value, dict):
        return {k: clone_tensors(v) for k, v in value.items()}
    return value


def floating_dtype(tensors: Iterable[torch.Tensor]) -> torch.dtype:
    """The dtype of the first floating-point tensor (a model's parameters: its dtype), fp32 where there is none."""
    return next((t.dtype for t in tensors if t.is_floating_point()), torch.float32)


def is_cache(value: Any) -> bool:
    """A model's cache: a ``transformers.cache_utils.Cache``, or an object whose class names itself one (remote
    code's and the hybrid models' own caches do not all derive from ``Cache``)."""
    if value is None or isinstance(value, (torch.Tensor, int, float, bool, str)):
        return False
    cache = getattr(sys.modules.get("transformers.cache_utils"), "Cache", None)
    return (cache is not None and isinstance(value, cache)) or "cache" in type(value).__name__.lower()


def copy_cache(cache: Any) -> Any:
    """A deep copy of a cache whose tensors are detached copies (a graph's tensors refuse ``deepcopy``)."""
    memo: dict[int, Any] = {}
    seen: set[int] = set()

    def collect(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            memo[id(obj)] = obj.detach().clone()
        elif isinstance(obj, dict):
            for v in obj.values():
                collect(v)
        elif isinstance(obj, (list, tuple, set)):
            for v in obj:
                collect(v)
        elif hasattr(obj, "__dict__") and not isinstance(obj, type):
            collect(vars(obj))

    collect(cache)
    return copy.deepcopy(cache, memo)


def move_tensors(value: Any, device: torch.device | None) -> Any:
    """Tensors (nested in tuples, lists and dicts) on ``device`` (``None``: where they are)."""
    if device is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(move_tensors(v, device) for v in value)
    if isinstance(value, dict):
        return {k: move_tensors(v, device) for k, v in value.items()}
    return value


def cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: cast_floats(v, dtype) for k, v in value.items()}
    return value


# ---- the judge: calibrated by the original's own rounding error ---------------------------

#: ``k``: a result that is not bit-equal to the original passes where it differs from it by at
#: most this many times the original's own rounding error (the original's distance from the
#: fp64 truth, :mod:`engine.verification.truth`). Two results with independent rounding errors
#: of the original's size differ by ~1.4x it (sqrt 2); 3 also passes a kernel up to ~2x less
#: accurate than transformers' own. See docs/verification.md for the measurements: correct
#: kernels on real checkpoints stay below 1.5, wrong declarations are 100x and more.
NOISE_FACTOR = 3.0

#: Plus this many units in the last place of the largest truth value, in the compared dtype: for
#: a tensor the original happens to compute exactly (its rounding error is zero, or a fraction
#: of an ulp for a scalar such as the loss), one rounding step apart is still the same number.
FLOOR_ULPS = 1.0

_CHUNK = 1 << 20  # elements per step (8 MiB in fp64): differences without a full-size fp64 copy, and few
# chunk-sized temporaries beside the logits they compare (they set the fp64 truth's peak at 4M)


def _chunk(t: torch.Tensor, start: int, device: torch.device) -> torch.Tensor:
    """Elements ``start:start + _CHUNK`` of flat ``t`` in fp64 on ``device`` (a tensor held on the host meets one on
    the accelerator a chunk at a time, never whole)."""
    return t[start:start + _CHUNK].to(device=device, dtype=torch.float64)


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b|`` computed in fp64, chunk by chunk (a gradient of a large embedding is 100M+ elements).

    ``a`` and ``b`` may live on different devices (one held on the host): each chunk of ``b``
    is brought to ``a``'s device.
    """
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    worst = 0.0
    wide = torch.promote_types(a.dtype, b.dtype)  # fp64 for the truth; cast first: 2x faster than a mixed sub
    for start in range(0, a.numel(), _CHUNK):
        x, y = a[start:start + _CHUNK].to(wide), b[start:start + _CHUNK].to(a.device, wide)
        d = torch.sub(x, y).abs_()
        found = float(d.max())
        if math.isnan(found):  # NaN where the other is a number: infinitely off; NaN against NaN: equal
            x, y = x.double(), y.double()
            d = (x - y).abs().masked_fill(x.isnan() & y.isnan(), 0.0)
            found = float(d.nan_to_num(nan=math.inf).max())  # (max(0.0, nan) would be 0.0)
        worst = max(worst, found)
    return worst


def max_abs(t: torch.Tensor) -> float:
    """``max |t|``, a chunk at a time (one pass each: the extremes, not a copy of ``|t|``)."""
    t = t.detach().reshape(-1)
    worst = 0.0
    for s in range(0, t.numel(), _CHUNK):
        low, high = torch.aminmax(t[s:s + _CHUNK])
        worst = max(worst, abs(float(low)), abs(float(high)))
        if math.isnan(float(low)) or math.isnan(float(high)):
            return math.nan  # a NaN anywhere: no scale (Python's max would quietly skip it)
    return worst


def ulp(x: float, dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s numbers at ``|x|`` (0 for 0 and for integer dtypes)."""
    if not dtype.is_floating_point or not x or not math.isfinite(x):
        return 0.0
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(abs(x)))


def allowed(noise: float, scale: float, dtype: torch.dtype) -> float:
    """The largest difference from the original that passes: ``k * noise + floor``."""
    return NOISE_FACTOR * noise + FLOOR_ULPS * ulp(scale, dtype)


def tensors_of(value: Any) -> list[Any]:
    """The leaves :func:`compare` compares, flattened in order (tensors, and other values as they are)."""
    if isinstance(value, Mapping):
        return [leaf for k, v in value.items() if isinstance(v, (torch.Tensor, tuple, list)) for leaf in tensors_of(v)]
    if isinstance(value, (tuple, list)):
        return [leaf for v in value for leaf in tensors_of(v)]
    return [value]


class Judged(tuple):
    """``(passed, note)`` as the judges always returned, and :attr:`limit`: the most ``|got - original|`` it allowed.

    Why a tuple: every caller unpacks ``passed, note = judge(...)``; the report shows the limit
    beside the difference (``1.6e-02 / 4.9e-02``), where a relative error of near-zero elements
    (``rel 3.6e+01``) said nothing about why a check passed. ``None``: bit-equal, or no single bound.
    """

    limit: float | None

    def __new__(cls, passed: bool, note: str, limit: float | None = None) -> Judged:
        self = super().__new__(cls, (passed, note))
        self.limit = limit
        return self


def _unlike(got: Any, original: Any) -> str:
    """What differs between a result and the original's beyond numbers: its kind, shape or dtype."""
    if not isinstance(got, torch.Tensor):
        return f"the patched forward returns {type(got).__name__} where the original returns a tensor"
    if got.shape != original.shape:
        return f"the patched result has shape {tuple(got.shape)}, the original's {tuple(original.shape)}"
    names = {t: DTYPE_NAMES.get(t, str(t)) for t in (got.dtype, original.dtype)}
    return (f"the patched result is {names[got.dtype]} where the original's is {names[original.dtype]} (a result "
            "of another dtype fails whatever its numbers; the errors beside it are measured after the cast)")


def judge(got: Any, original: Any, truth: Any, bound: float = 1.0) -> Judged:
    """Whether ``got`` is within the original's own rounding error of it; ``(passed, note)``.

    ``truth`` is the original evaluated in fp64 on the same inputs. Each tensor passes where
    ``max|got - original| <= bound * (k * max|original - truth| + floor)`` (:data:`NOISE_FACTOR`,
    :data:`FLOOR_ULPS`; ``bound`` > 1 for a bf16 model's whole-model values:
    :mod:`engine.verification.low_precision`); bit-equal tensors pass without looking at the truth.
    """
    leaves = list(zip(tensors_of(got), tensors_of(original), tensors_of(truth), strict=False))
    worst: tuple[float, float, float, float, float] | None = None  # ratio, diff, noise, far, limit
    for g, o, t in leaves:
        if not isinstance(o, torch.Tensor):
            if g != o:
                return Judged(False, "outputs differ in a non-tensor value")
            continue
        if not isinstance(g, torch.Tensor) or g.shape != o.shape or g.dtype != o.dtype:
            return Judged(False, _unlike(g, o))
        if torch.equal(g, o):
            continue
        diff = max_abs_diff(g, o)
        ratio, noise, limit = _ratio(diff, o, t)
        if worst is None or ratio > worst[0]:
            worst = (ratio, diff, noise, max_abs_diff(g, t), limit)
    if worst is None:
        return Judged(True, "")
    ratio, diff, noise, far, limit = worst
    return Judged(ratio <= bound, noise_note(diff, noise, far), bound * limit)


def judge_difference(diff: float, original: torch.Tensor, truth: torch.Tensor, bound: float = 1.0) -> Judged:
    """:func:`judge` of one tensor whose difference ``diff = max|got - original|`` was taken before ``got`` was dropped.

    Why: a ``[tokens, vocab]`` result held only to be judged costs its size at the truth's peak;
    the rule needs only that difference, the original and the truth (the note then cannot say
    how far the patched result is from the truth).
    """
    ratio, noise, limit = _ratio(diff, original, truth)
    return Judged(ratio <= bound, noise_note(diff, noise), bound * limit)


def _ratio(diff: float, original: torch.Tensor, truth: torch.Tensor) -> tuple[float, float, float]:
    """``(diff / the limit the rule allows, the original's own error, the limit)``: the rule :func:`judge` applies."""
    noise = max_abs_diff(original, truth)
    limit = allowed(noise, max_abs(truth), original.dtype)
    return (diff / limit if limit else float("inf")), noise, limit


def noise_note(diff: float, noise: float, far: float | None = None) -> str:
    """How the difference compares with the original's own error, for the report."""
    times = f"{diff / noise:.2g}x" if noise else "inf x"
    text = f"vs original {diff:.2g} = {times} the original's own error vs fp64 ({noise:.2g})"
    return text + (f"; patched vs fp64 {far:.2g}" if far is not None else "")
