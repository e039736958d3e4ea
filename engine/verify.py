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
from engine.kernels import registry
from engine.ops.base import ModuleOp, get_op
from engine.report import format_table

__all__ = ["Check", "VerifyReport", "verify", "compare", "TOLERANCES", "probe_batch", "compare_models"]

#: (atol, rtol) per dtype for kernel-vs-original comparisons (torch.testing's defaults).
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1.3e-6),
    torch.float64: (1e-7, 1e-7),
    torch.bfloat16: (1e-5, 1.6e-2),
    torch.float16: (1e-5, 1e-3),
}
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


@dataclass
class Check:
    """One comparison: a module (or function, or the whole model) in one dtype."""

    path: str
    cls: str
    op: str
    what: str  # "declaration", "kernel <name>", "logits", "loss", "grad <name>"
    dtype: str
    max_abs: float
    max_rel: float
    passed: bool
    note: str = ""


@dataclass
class VerifyReport:
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def table(self) -> str:
        return format_table(
            ("module", "class", "op", "check", "dtype", "max abs", "max rel", "result", "note"),
            (
                (c.path, c.cls, c.op, c.what, c.dtype, f"{c.max_abs:.2e}", f"{c.max_rel:.2e}",
                 "ok" if c.passed else "FAIL", c.note)
                for c in self.checks
            ),
        )

    def to_dict(self) -> dict[str, Any]:
        return {"passed": self.passed, "checks": [vars(c) for c in self.checks]}

    def __str__(self) -> str:
        verdict = "passed" if self.passed else f"FAILED ({len(self.failures)} checks)"
        return f"verification {verdict}\n{self.table()}"


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
    if actual.dtype != expected.dtype:  # e.g. an fp32 result where the module returns bf16
        return float("inf"), float("inf"), False
    atol, rtol = TOLERANCES.get(expected.dtype, (1e-5, 1e-5))
    a, e = actual.detach().double(), expected.detach().double()
    if not (torch.isfinite(a).all() and torch.isfinite(e).all()):
        same = torch.equal(a.nan_to_num(), e.nan_to_num())
        return (0.0, 0.0, same) if same else (float("inf"), float("inf"), False)
    diff = (a - e).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    max_rel = float((diff / e.abs().clamp_min(1e-12)).max()) if diff.numel() else 0.0
    ok = bool((diff <= atol + rtol * e.abs()).all())
    return max_abs, max_rel, ok


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
    finally:
        for h in handles:
            h.remove()
        for router, observe in observers:
            router.observers.remove(observe)
    return captured


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

    Raises:
        VerificationFailed: on any failed check (unless ``raise_on_failure=False``); the
            message names each failing module path and class, the declared settings, and
            the alternative settings that would have matched.
    """
    from engine.patcher import STATE_ATTR, apply

    if patchset is not None and STATE_ATTR not in model.__dict__:
        model = copy.deepcopy(model)
        apply(model, patchset, **apply_kwargs)
    state = model.__dict__.get(STATE_ATTR)
    if state is None:
        raise ValueError("the model is not patched; pass a patchset or call engine.apply first")
    decisions = [d for d in state.report.decisions if d.action == "patch"]
    batch = batch or probe_batch(model)
    report = VerifyReport()
    captured = _capture(model, decisions, batch)
    low = _low_precision(model)
    modules = dict(model.named_modules())
    for d in decisions:
        if d.path not in captured:
            report.checks.append(Check(d.path, d.cls, d.op, "called", "-", 0.0, 0.0, False,
                                       "never called during the verification forward: the patch is a no-op"))
            continue
        args, kwargs = captured[d.path]
        if d.site is None:
            report.checks.extend(_verify_module(d, modules[d.path], args, kwargs, low))
        else:
            report.checks.extend(_verify_function(d, args, kwargs, low))
    if check_model:
        report.checks.extend(compare_models(model, batch))
    if raise_on_failure and not report.passed:
        raise VerificationFailed(_failure_message(report))
    return report


def _settings(patch: Any) -> str:
    data = patch.model_dump(mode="json", exclude={"kernel", "optional", "target", "function", "op"})
    return ", ".join(f"{k}: {v}" for k, v in data.items()) or "defaults"


def _verify_module(d: Any, module: nn.Module, args: Any, kwargs: Any, low: torch.dtype) -> list[Check]:
    op = get_op(d.op)
    assert isinstance(op, ModuleOp)
    checks: list[Check] = []
    reference = registry.get("torch", d.op)
    alt_exact: dict[str, bool] = {}
    decl_results = []
    for dtype in (torch.float32, low):
        clone = copy.deepcopy(module).to(dtype)
        a, k = _cast_floats(args, dtype), _cast_floats(kwargs, dtype)
        with torch.no_grad():
            expected = type(clone).forward(clone, *a, **k)
            declared = op.bind(clone, d.patch, reference.build(d.patch))(clone, *a, **k)
            decl = compare(declared, expected)
            decl_results.append((dtype, decl))
            for label, alt in op.alternatives(d.patch):
                got = op.bind(clone, alt, reference.build(alt))(clone, *a, **k)
                err = compare(got, expected)
                alt_exact[label] = alt_exact.get(label, True) and err[0] == 0.0
            if d.kernel != "torch":
                patched = clone.forward(*a, **k)
                ma, mr, ok = compare(patched, expected)
                checks.append(Check(d.path, d.cls, d.op, f"kernel {d.kernel}", _DTYPE_NAMES[dtype], ma, mr, ok))
    declared_exact = all(r[0] == 0.0 for _, r in decl_results)
    fits = [label for label, exact in alt_exact.items() if exact]
    declaration_checks = []
    for dtype, (ma, mr, ok) in decl_results:
        note = ""
        passed = ok
        if not declared_exact and fits:
            passed = False
            note = f"declared ({_settings(d.patch)}) does not reproduce the module; {' or '.join(fits)} fits"
        elif not ok and not fits:
            note = f"declared ({_settings(d.patch)}) does not reproduce the module, nor does any alternative"
        declaration_checks.append(Check(d.path, d.cls, d.op, "declaration", _DTYPE_NAMES[dtype], ma, mr, passed, note))
    return declaration_checks + checks


def _verify_function(d: Any, args: Any, kwargs: Any, low: torch.dtype) -> list[Check]:
    router = routing.router_for(d.site.namespace, d.site.function)
    assert router is not None
    impl = d.provider.build(d.patch)
    checks = []
    for dtype in (torch.float32, low):
        a, k = _cast_floats(args, dtype), _cast_floats(kwargs, dtype)
        with torch.no_grad():
            ma, mr, ok = compare(impl(*a, **k), router.original(*a, **k))
        checks.append(Check(d.path, "function", d.op, f"kernel {d.kernel}", _DTYPE_NAMES[dtype], ma, mr, ok))
    return checks


def compare_models(
    patched: nn.Module, batch: dict[str, torch.Tensor], reference: nn.Module | None = None
) -> list[Check]:
    """Logits, loss and parameter gradients of ``patched`` vs its unpatched deep copy."""
    from engine.patcher import revert

    if reference is None:
        reference = copy.deepcopy(patched)
        revert(reference)
    results = []
    outputs = []
    for m in (reference, patched):
        m.zero_grad(set_to_none=True)
        out = m(**batch)
        out.loss.backward()
        outputs.append(out)
    ref_out, pat_out = outputs
    dtype = _DTYPE_NAMES.get(ref_out.logits.dtype, str(ref_out.logits.dtype))
    pat_logits, logits_what = pat_out.logits, "logits"
    if pat_logits is None:  # a fused head + loss does not materialize them: compare the generation path
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with torch.no_grad():
            pat_logits = patched(**inputs).logits
        logits_what = "logits (no labels)"
    for what, a, e in ((logits_what, pat_logits, ref_out.logits), ("loss", pat_out.loss, ref_out.loss)):
        ma, mr, ok = compare(a, e)
        results.append(Check("<model>", type(patched).__name__, "-", what, dtype, ma, mr, ok))
    ref_params = dict(reference.named_parameters())
    worst: tuple[float, float, bool, str] = (0.0, 0.0, True, "")
    for name, p in patched.named_parameters():
        q = ref_params[name]
        if p.grad is None and q.grad is None:
            continue
        if p.grad is None or q.grad is None:
            worst = (float("inf"), float("inf"), False, name)
            break
        ma, mr, ok = compare(p.grad, q.grad)
        if not ok or ma > worst[0]:
            worst = (ma, mr, ok and worst[2], name if (not ok or ma > worst[0]) else worst[3])
    patched.zero_grad(set_to_none=True)
    results.append(Check("<model>", type(patched).__name__, "-", f"grads (worst: {worst[3] or '-'})", dtype,
                         worst[0], worst[1], worst[2]))
    return results


def _failure_message(report: VerifyReport) -> str:
    lines = ["patched model does not compute what the original computed:"]
    seen: set[tuple[str, str]] = set()
    for c in report.failures:
        if (c.path, c.what) in seen:
            continue
        seen.add((c.path, c.what))
        errs = ", ".join(f"{f.dtype} {f.max_abs:.3g}" for f in report.failures if (f.path, f.what) == (c.path, c.what))
        lines.append(f"  {c.path} ({c.cls}, {c.op}) {c.what}: max abs err {errs}" + (f"; {c.note}" if c.note else ""))
    return "\n".join(lines)
