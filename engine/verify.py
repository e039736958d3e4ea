"""Numerical verification: does the patched model compute what the original computed?

Two questions are asked of every patched module, on inputs captured from a real forward
of the model (so shapes, gates and dtypes are the ones the model really uses), run on a
deep copy of the module with its *own* weights:

1. **Is the declaration right?** The op's torch reference with the declared settings is
   compared with the module's original forward, in fp32 and in bf16 (where cast orders
   differ). Every alternative declaration the op knows (``scale``, ``cast``, activation,
   ...) is tried too; if the declared one misses while an alternative matches, the error
   says which one fits. This is what catches ``one_plus_weight`` declared on a ``weight``
   norm, whatever the weights' values.
2. **Does the kernel agree?** The patched forward (the chosen kernel) is compared with the
   original within a tolerance per dtype.

Then the whole model: logits, loss and every parameter gradient, patched vs unpatched.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine import routing
from engine.errors import VerificationFailed
from engine.hub_functions import torch_body, torch_path
from engine.kernels import registry
from engine.ops.base import ModuleOp, get_op
from engine.report import format_table

__all__ = ["MODEL", "TOLERANCES", "Check", "VerifyReport", "compare", "compare_models", "probe_batch", "verify"]

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
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}
#: The ``path`` of whole-model checks.
MODEL = "<model>"


@dataclass
class Check:
    """One comparison: a module (or function, or the whole model) in one dtype.

    ``what`` is ``declaration`` (the op's reference with the declared settings vs the
    original forward: must be bit-exact, or no alternative may fit better), ``kernel`` (the
    chosen kernel vs the original, within :data:`TOLERANCES`), ``called`` (the target ran
    at all), or, for ``<model>``, ``logits``, ``loss`` and ``grads``.
    """

    path: str
    cls: str
    op: str
    what: str
    dtype: str
    max_abs: float
    max_rel: float
    passed: bool
    note: str = ""
    kernel: str = "-"


def _num(x: float) -> str:
    if x == 0:
        return "0"
    if x == float("inf"):
        return "inf"
    return f"{x:.1e}"


def _short(path: str) -> str:
    """A function patch's path without the ``transformers.models.`` every one of them starts with."""
    return path.removeprefix("transformers.models.")


@dataclass
class VerifyReport:
    """Every check of one verification, with a per-module table for people and a dict for machines."""

    checks: list[Check] = field(default_factory=list)
    model_dtype: str = "fp32"
    dtypes: tuple[str, ...] = ("fp32", "bf16")

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def rows(self) -> list[dict[str, Any]]:
        """One row per patched module or function (worst error per dtype), then one per model check."""
        rows: dict[str, dict[str, Any]] = {}
        for c in self.checks:
            key = c.path if c.path != MODEL else f"{MODEL} {c.what.split(' ')[0]}"
            row = rows.setdefault(key, {"module": key, "class": c.cls, "op": c.op, "kernel": c.kernel,
                                        "errors": {}, "passed": True, "notes": []})
            if c.kernel != "-":
                row["kernel"] = c.kernel
            if c.dtype in self.dtypes or c.dtype == self.model_dtype:
                worst = row["errors"].get(c.dtype, (0.0, 0.0))
                row["errors"][c.dtype] = (max(worst[0], c.max_abs), max(worst[1], c.max_rel))
            row["passed"] = row["passed"] and c.passed
            if c.note and c.note not in row["notes"] and (not c.passed or c.path == MODEL):
                row["notes"].append(c.note)
        return list(rows.values())

    def table(self, *, detail: bool = False) -> str:
        """An aligned table: one row per module (``detail``: one row per check)."""
        if detail:
            return format_table(
                ("module", "class", "op", "kernel", "check", "dtype", "max abs", "max rel", "result", "note"),
                ((c.path, c.cls, c.op, c.kernel, c.what, c.dtype, _num(c.max_abs), _num(c.max_rel),
                  "ok" if c.passed else "FAIL", c.note) for c in self.checks),
            )
        dtypes = list(dict.fromkeys((*self.dtypes, self.model_dtype)))
        body = []
        for row in self.rows():
            errs = [row["errors"].get(dt) for dt in dtypes]
            cells = [f"{_num(e[0])} / {_num(e[1])}" if e else "-" for e in errs]
            body.append((_short(row["module"]), row["class"], row["op"], row["kernel"], *cells,
                         "ok" if row["passed"] else "FAIL", "; ".join(row["notes"])))
        return format_table(
            ("module", "class", "op", "kernel", *(f"{dt} abs / rel" for dt in dtypes), "result", "note"), body
        )

    def legend(self) -> str:
        tol = ", ".join(
            f"{name} {TOLERANCES[dt][0]:g}+{TOLERANCES[dt][1]:g}*max|ref|"
            for dt, name in _DTYPE_NAMES.items() if name in (*self.dtypes, self.model_dtype)
        )
        return (
            "checks: declaration = the op's reference with the declared settings vs the original forward,\n"
            "        bit-exact in every dtype; kernel = the chosen kernel vs the original, within " + tol + ";\n"
            f"        {MODEL} = logits, loss and every parameter gradient vs the unpatched model ({self.model_dtype})"
            + ("; where not equal, at most 2x as far from the fp32 model as the original"
               if self.model_dtype in ("bf16", "fp16") else "")
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "model_dtype": self.model_dtype,
            "dtypes": list(self.dtypes),
            "tolerances": {_DTYPE_NAMES[dt]: {"atol": a, "rtol": r} for dt, (a, r) in TOLERANCES.items()},
            "modules": [
                {**{k: v for k, v in row.items() if k != "errors"},
                 "errors": {dt: {"max_abs": e[0], "max_rel": e[1]} for dt, e in row["errors"].items()}}
                for row in self.rows()
            ],
            "checks": [vars(c) for c in self.checks],
        }

    def __str__(self) -> str:
        modules = sum(1 for r in self.rows() if not r["module"].startswith(MODEL))
        verdict = "passed" if self.passed else f"FAILED ({len(self.failures)} of {len(self.checks)} checks)"
        head = (f"verification {verdict}: {modules} patched modules and functions, {len(self.checks)} checks, "
                f"model dtype {self.model_dtype}, modules checked in {' and '.join(self.dtypes)}")
        return f"{head}\n{self.table()}\n{self.legend()}"


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


def _exact(result: tuple[float, float, bool]) -> bool:
    """Bit-exact: same dtype and shape, zero difference."""
    return result[2] and result[0] == 0.0


def probe_batch(model: nn.Module, *, batch: int = 2, seq: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """A deterministic random batch of token ids (with labels) for a causal LM."""
    vocab = int(model.config.vocab_size)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    return {"input_ids": ids, "labels": ids.clone()}


def _cast_floats(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_cast_floats(v, dtype) for v in value)
    if isinstance(value, dict):
        return {k: _cast_floats(v, dtype) for k, v in value.items()}
    return value


def _capture(model: nn.Module, decisions: Sequence[Any], batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Run one forward and record the first inputs of every patched module and function."""
    captured: dict[str, Any] = {}
    modules = dict(model.named_modules())
    handles = []
    observers: list[tuple[routing.FunctionRouter, Callable[..., None]]] = []
    for d in decisions:
        if d.site is None:

            def hook(module: nn.Module, args: Any, kwargs: Any, _path: str = d.path) -> None:
                captured.setdefault(_path, (_cast_floats(args, torch.float32), _cast_floats(kwargs, torch.float32)))

            handles.append(modules[d.path].register_forward_pre_hook(hook, with_kwargs=True))
        else:
            router = routing.router_for(d.site.namespace, d.site.function)
            if router is None:
                continue

            def observe(args: Any, kwargs: Any, _path: str = d.path) -> None:
                captured.setdefault(_path, (_cast_floats(args, torch.float32), _cast_floats(kwargs, torch.float32)))

            router.observers.append(observe)
            observers.append((router, observe))
    try:
        with torch.no_grad():
            model(**{k: v for k, v in batch.items() if k != "labels"})
            if any(d.path not in captured for d in decisions):
                _decode_step(model, batch)
    finally:
        for h in handles:
            h.remove()
        for router, observe in observers:
            router.observers.remove(observe)
    return captured


def _decode_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    """Prefill, then one cached token: reaches functions only decode calls (a recurrent kernel).

    A model that cannot decode this way simply leaves those functions uncaptured, and the
    verification reports them as never called.
    """
    ids = batch["input_ids"]
    if ids.shape[-1] < 2:
        return
    try:
        out = model(input_ids=ids[:, :-1], use_cache=True)
        cache = getattr(out, "past_key_values", None)
        if cache is not None:
            model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
    except (TypeError, ValueError, NotImplementedError):
        return


def _low_precision(model: nn.Module) -> torch.dtype:
    dtype = next(model.parameters()).dtype
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16


def verify(
    model: nn.Module,
    patchset: Any = None,
    *,
    batch: dict[str, torch.Tensor] | None = None,
    check_model: bool = True,
    raise_on_failure: bool = True,
    **apply_kwargs: Any,
) -> VerifyReport:
    """Verify a patched model (or, given ``patchset``, a patched deep copy of an unpatched one).

    Every patched module is checked on the inputs it received in one real forward, in fp32
    and in the model's low-precision dtype (bf16 for an fp32 model, where cast orders
    differ); then the whole model (logits, loss, parameter gradients) in its own dtype.

    Raises:
        VerificationFailed: on any failed check (unless ``raise_on_failure=False``); the
            message names each failing module path and class, the declared settings, and
            the alternative settings that would have matched. ``exc.report`` has every check.
    """
    from engine.patcher import STATE_ATTR, apply, revert
    from engine.wrappers import unwrap

    model = unwrap(model)
    if patchset is not None and STATE_ATTR not in model.__dict__:
        twin = copy.deepcopy(model)
        apply(twin, patchset, **apply_kwargs)
        try:
            return verify(twin, batch=batch, check_model=check_model, raise_on_failure=raise_on_failure)
        finally:
            revert(twin)  # releases its function routers: the copy must not keep them installed
    state = model.__dict__.get(STATE_ATTR)
    if state is None:
        raise ValueError("the model is not patched; pass a patchset or call engine.apply first")
    decisions = [d for d in state.report.decisions if d.action == "patch"]
    batch = batch or probe_batch(model)
    low = _low_precision(model)
    model_dtype = next(model.parameters()).dtype
    report = VerifyReport(
        model_dtype=_DTYPE_NAMES.get(model_dtype, str(model_dtype)), dtypes=("fp32", _DTYPE_NAMES[low])
    )
    captured = _capture(model, decisions, batch)
    modules = dict(model.named_modules())
    for d in decisions:
        if d.path not in captured:
            cls = d.cls if d.site is None else "function"
            report.checks.append(Check(d.path, cls, d.op, "called", "-", 0.0, 0.0, False, _NOT_CALLED, d.kernel or "-"))
            continue
        args, kwargs = captured[d.path]
        if d.site is None:
            report.checks.extend(_verify_module(d, modules[d.path], args, kwargs, low))
        else:
            report.checks.extend(_verify_function(d, args, kwargs, low))
    if check_model:
        report.checks.extend(compare_models(model, batch))
    if raise_on_failure and not report.passed:
        error = VerificationFailed(_failure_message(report))
        error.report = report  # type: ignore[attr-defined]
        raise error
    return report


_NOT_CALLED = (
    "never called during the verification forward, so this patch changes nothing for this model: "
    "remove it, or check that the config exercises it"
)
#: Patch keys that say what to patch and how to run it, not what the target computes.
_NOT_SETTINGS = {"kernel", "optional", "target", "function", "op", "signature"}


def _settings(patch: Any, keys: Sequence[str] | None = None) -> str:
    data = patch.model_dump(mode="json", exclude=_NOT_SETTINGS)
    keys = [k for k in (keys or data) if k in data]
    return ", ".join(f"{k}: {data[k]}" for k in keys) or "defaults"


def _varied_keys(patch: Any, alternatives: Sequence[Any]) -> list[str]:
    """The settings the alternatives vary (those worth showing next to the declared ones)."""
    mine = patch.model_dump(mode="json", exclude=_NOT_SETTINGS)
    dumps = [alt.model_dump(mode="json", exclude=_NOT_SETTINGS) for alt in alternatives]
    return [k for k in mine if any(d.get(k) != mine[k] for d in dumps)] or list(mine)


def _verify_module(d: Any, module: nn.Module, args: Any, kwargs: Any, low: torch.dtype) -> list[Check]:
    """Declaration (bit-exact, against every alternative) and kernel (within tolerance) checks."""
    op = get_op(d.op)
    assert isinstance(op, ModuleOp)
    reference = registry.get("torch", d.op)
    alternatives = list(op.alternatives(d.patch))
    alt_exact = {label: True for label, _ in alternatives}
    decl_results: list[tuple[torch.dtype, tuple[float, float, bool]]] = []
    kernel_checks: list[Check] = []
    declared_out: dict[torch.dtype, Any] = {}
    originals: dict[torch.dtype, Any] = {}
    for dtype in (torch.float32, low):
        clone = copy.deepcopy(module).to(dtype)
        a, k = _cast_floats(args, dtype), _cast_floats(kwargs, dtype)
        with torch.no_grad():
            expected = type(clone).forward(clone, *a, **k)
            declared = op.bind(clone, d.patch, reference.build(d.patch))(clone, *a, **k)
            decl_results.append((dtype, compare(declared, expected)))
            declared_out[dtype], originals[dtype] = declared, expected
            for label, alt in alternatives:
                got = op.bind(clone, alt, reference.build(alt))(clone, *a, **k)
                alt_exact[label] = alt_exact[label] and _exact(compare(got, expected))
            if d.kernel != "torch":  # the torch kernel *is* the declaration, checked above
                ma, mr, ok = compare(clone.forward(*a, **k), expected)
                kernel_checks.append(Check(d.path, d.cls, d.op, "kernel", _DTYPE_NAMES[dtype], ma, mr, ok, "", d.kernel))
    declared_exact = all(_exact(r) for _, r in decl_results)
    fits = [label for label, exact in alt_exact.items() if exact]
    declared_text = _settings(d.patch, _varied_keys(d.patch, [alt for _, alt in alternatives]))
    checks = []
    for dtype, (ma, mr, ok) in decl_results:
        note, passed = "", ok
        if not declared_exact and fits:
            passed = False
            note = f"declared {declared_text} does not reproduce {d.cls}.forward; {' or '.join(fits)} fits"
        elif not ok:
            tried = ", nor does any alternative" if alternatives else ""
            kind = "" if _dtype_of(declared_out[dtype]) == _dtype_of(originals[dtype]) else (
                f" (returns {_dtype_of(declared_out[dtype])} where the original returns {_dtype_of(originals[dtype])})")
            note = f"declared {declared_text} does not reproduce {d.cls}.forward{kind}{tried}; is this the right op?"
        checks.append(Check(d.path, d.cls, d.op, "declaration", _DTYPE_NAMES[dtype], ma, mr, passed, note, d.kernel))
    return checks + kernel_checks


def _dtype_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return _DTYPE_NAMES.get(value.dtype, str(value.dtype))
    return type(value).__name__


def _verify_function(d: Any, args: Any, kwargs: Any, low: torch.dtype) -> list[Check]:
    router = routing.router_for(d.site.namespace, d.site.function)
    assert router is not None
    impl = d.provider.build(d.patch)
    checks = []
    for dtype in (torch.float32, low):
        a, k = _cast_floats(args, dtype), _cast_floats(kwargs, dtype)
        with torch.no_grad():
            # The original's torch body: transformers may have bound the name to a package
            # (fla) that does not run on this device; its torch function is the ground truth.
            ma, mr, ok = compare(impl(*a, **k), torch_body(router.original)(*a, **k))
        note = "" if ok else f"kernel {d.kernel} does not compute what {d.site.function} computes"
        checks.append(Check(d.path, "function", d.op, "kernel", _DTYPE_NAMES[dtype], ma, mr, ok, note, d.kernel))
    return checks


def compare_models(
    patched: nn.Module, batch: dict[str, torch.Tensor], reference: nn.Module | None = None
) -> list[Check]:
    """Logits, loss and parameter gradients of ``patched`` vs ``reference`` (default: its unpatched deep copy)."""
    from engine.patcher import revert

    if reference is None:
        reference = copy.deepcopy(patched)
        revert(reference)
    # The unpatched reference runs transformers' torch functions even where transformers
    # bound them to a package at import (fla on a CPU); no-op otherwise. The patched model
    # runs as it is: if it still reaches fla on a CPU, verification must fail, not hide it.
    with torch_path(reference):
        ref_out = _forward_backward(reference, batch)
    pat_out = _forward_backward(patched, batch)
    cls = type(patched).__name__
    dtype = _DTYPE_NAMES.get(ref_out.logits.dtype, str(ref_out.logits.dtype))
    pat_logits, logits_what = pat_out.logits, "logits"
    if pat_logits is None:  # a fused head + loss does not materialize them: compare the generation path
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with torch.no_grad():
            pat_logits = patched(**inputs).logits
        logits_what = "logits (no labels)"
    checks = [
        Check(MODEL, cls, "-", what, dtype, *compare(got, want))
        for what, got, want in ((logits_what, pat_logits, ref_out.logits), ("loss", pat_out.loss, ref_out.loss))
    ]
    checks.append(_compare_grads(patched, reference, cls, dtype))
    if ref_out.logits.dtype in (torch.bfloat16, torch.float16) and any(c.max_abs != 0.0 for c in checks):
        _judge_against_fp32(checks, patched, reference, batch, pat_logits, pat_out.loss, ref_out)
    patched.zero_grad(set_to_none=True)
    return checks


#: A low-precision patched model passes where it is at most this many times further from the
#: fp32 model than transformers' own low-precision model is.
LOW_PRECISION_FACTOR = 2.0


def _judge_against_fp32(
    checks: list[Check], patched: nn.Module, reference: nn.Module, batch: dict[str, torch.Tensor],
    pat_logits: torch.Tensor, pat_loss: torch.Tensor, ref_out: Any,
) -> None:
    """Judge the whole-model checks of a bf16/fp16 model that is not bit-equal against the fp32 model.

    Why: a fused kernel that rounds once where eager rounds twice is not bit-equal to the
    eager model, and after a few layers no fixed tolerance separates that from a bug. The
    question that matters is whether the patched model is as faithful to the exact (fp32)
    computation as the original low-precision model is. The weights are the same (the fp32
    model is the reference cast up), so the fp32 run is the ground truth both approximate.
    """
    truth = copy.deepcopy(reference).float()
    with torch_path(truth):
        truth_out = _forward_backward(truth, batch)
    pairs = {checks[0].what: (pat_logits, ref_out.logits, truth_out.logits), "loss": (pat_loss, ref_out.loss, truth_out.loss)}
    for check in checks:
        if check.what in pairs:
            got, ref, exact = pairs[check.what]
            ok, note = _as_faithful(got, ref, exact)
        else:  # grads: every parameter
            truth_grads = dict(truth.named_parameters())
            ref_grads = dict(reference.named_parameters())
            verdicts = []
            for name, p in patched.named_parameters():
                if p.grad is None or ref_grads[name].grad is None:
                    continue
                verdicts.append((*_as_faithful(p.grad, ref_grads[name].grad, truth_grads[name].grad), name))
            bad = [v for v in verdicts if not v[0]]
            ok = bool(verdicts) and not bad and "no gradient" not in check.note
            note = f"{len(bad)} of {len(verdicts)} gradients further from fp32 than the original's" if bad else (
                f"every gradient as close to fp32 as the original's (factor {LOW_PRECISION_FACTOR:g})")
        check.passed = ok
        check.note = note


def _as_faithful(got: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor | None) -> tuple[bool, str]:
    if exact is None or got.dtype != ref.dtype:
        return False, "dtype differs" if exact is not None else "no fp32 counterpart"
    e = exact.detach().double()
    err_patched = float((got.detach().double() - e).abs().max())
    err_original = float((ref.detach().double() - e).abs().max())
    scale = float(e.abs().max()) if e.numel() else 0.0
    ok = err_patched <= LOW_PRECISION_FACTOR * err_original + 1e-6 * scale
    return ok, f"vs fp32: patched {err_patched:.2g}, original {err_original:.2g}"


def _forward_backward(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out


def _compare_grads(patched: nn.Module, reference: nn.Module, cls: str, dtype: str) -> Check:
    """One check for all parameter gradients: the worst parameter's errors, and how many differ.

    A gradient present on one side only (a kernel that detaches, or one that reaches a
    parameter the original does not) is a failure of its own kind, named in the note.
    """
    ref_params = dict(reference.named_parameters())
    results: list[tuple[float, float, bool, str]] = []
    for name, p in patched.named_parameters():
        mine, theirs = p.grad, ref_params[name].grad
        if mine is None and theirs is None:
            continue
        if mine is None or theirs is None:
            side = "patched" if mine is None else "original"
            results.append((float("inf"), float("inf"), False, f"{name} (no gradient in the {side} model)"))
            continue
        results.append((*compare(mine, theirs), name))
    if not results:
        return Check(MODEL, cls, "-", "grads", dtype, 0.0, 0.0, False, "no parameter received a gradient")
    failing = [r for r in results if not r[2]]
    worst = max(failing or results, key=lambda r: (r[0], r[1]))
    if failing:
        note = f"{len(failing)} of {len(results)} parameter gradients differ; worst: {worst[3]}"
    else:
        note = f"{len(results)} parameter gradients; largest difference: {worst[3] if worst[0] else 'none'}"
    return Check(MODEL, cls, "-", "grads", dtype, worst[0], worst[1], not failing, note)


def _failure_message(report: VerifyReport) -> str:
    """One line per failing (class, check, note), naming the modules, dtypes and errors."""
    groups: dict[tuple[str, str, str, str], list[Check]] = {}
    for c in report.failures:
        groups.setdefault((c.cls, c.op, c.what, c.note), []).append(c)
    lines = ["patched model does not compute what the original computed:"]
    for (cls, op, what, note), checks in groups.items():
        paths = list(dict.fromkeys(c.path for c in checks))
        shown = ", ".join(paths[:4])
        where = shown if len(paths) <= 4 else f"{shown} and {len(paths) - 4} more"
        errs = {}
        for c in checks:
            if c.dtype != "-":
                errs[c.dtype] = max(errs.get(c.dtype, 0.0), c.max_abs)
        err_text = ", ".join(f"{dt} {_num(e)}" for dt, e in errs.items())
        label = what if cls == "function" or paths[0] == MODEL else f"{what} of {op}"
        line = f"  {where} ({cls}): {label} failed"
        if err_text:
            line += f" (max abs err {err_text})"
        lines.append(line + (f": {note}" if note else ""))
    return "\n".join(lines)
