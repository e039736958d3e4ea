"""Checks of one patched module or function against its original.

A module is asked two questions: is the declaration right (the op's torch reference with the
declared settings, and with every alternative the op knows, vs the original forward, bit-exact),
and does the chosen kernel agree (bit-equal, or within the original's own rounding error: see
:func:`engine.verification.compare.judge`). A function: does the kernel agree with the
function's torch body, judged the same way.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from engine.kernels import compiled
from engine.ops.base import ModuleOp, get_op
from engine.patching.patcher import original_forwards
from engine.runtime import routing
from engine.runtime.hub_functions import torch_body, torch_path
from engine.verification.compare import (
    DTYPE_NAMES,
    TOLERANCES,
    cast_floats,
    clone_tensors,
    compare,
    is_exact,
    judge,
    max_abs,
    tensors_of,
)
from engine.verification.random_state import same_draws
from engine.verification.results import Check
from engine.verification.truth import fp64_truth

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


def verify_module(
    d: Any, module: nn.Module, args: Any, kwargs: Any, low: torch.dtype, *, within: nn.Module | None = None
) -> list[Check]:
    """Declaration (bit-exact, against every alternative) and kernel (judged by the original's own error) checks.

    Each dtype runs on a copy of this one module cast to it. ``within``: the module holds other
    patched modules of that model (the fused head's target is the model itself), so it is not
    copied: it is checked in place in its own dtype, its declaration with every forward of the
    model original (:func:`engine.patching.patcher.original_forwards`); its kernel's numbers are the
    whole model's, judged by the ``<model>`` checks.
    """
    op = get_op(d.op)
    assert isinstance(op, ModuleOp)
    alternatives = list(op.module_alternatives(d.patch, module))
    alt_exact = {label: True for label, _ in alternatives}
    decl_results: list[tuple[torch.dtype, tuple[float, float, bool]]] = []
    kernel_checks: list[Check] = []
    declared_out: dict[torch.dtype, Any] = {}
    originals: dict[torch.dtype, Any] = {}
    own = next(module.parameters(), torch.empty(0)).dtype
    for dtype in ((own,) if within is not None else (torch.float32, low)):
        clone = module if within is not None else copy.deepcopy(module).to(dtype)
        a, k = cast_floats(args, dtype), cast_floats(kwargs, dtype)
        with torch.no_grad(), _original(within):
            with same_draws(clone):  # each run draws the same dropout masks (a LoRA adapter's, in training)
                expected = op.ground_truth(clone)(clone, *a, **k)
            with same_draws(clone):
                declared = op.bind(clone, d.patch, op.reference(d.patch))(clone, *a, **k)
            decl_results.append((dtype, compare(declared, expected)))
            declared_out[dtype], originals[dtype] = declared, expected
            for label, alt in alternatives:
                with same_draws(clone):
                    got = op.bind(clone, alt, op.reference(alt))(clone, *a, **k)
                alt_exact[label] = alt_exact[label] and is_exact(compare(got, expected))
        if d.kernel != "torch" and within is None:  # the torch kernel *is* the declaration, checked above
            with torch.no_grad(), same_draws(clone), _as_at_scale(d, dtype):
                got = clone.forward(*a, **k)
            ma, mr, _ = compare(got, expected)
            verdict = _judge(got, expected, op.ground_truth(clone), (clone, *a), k, clone)
            (ok, note), counted = verdict, True
            if not ok and dtype != own and (why := _unverified_elsewhere(d, dtype)) is not None:
                # measured to fail in this dtype, which this model does not run: shown, not counted
                ok, note, counted = True, f"not counted (the model is {DTYPE_NAMES.get(own, own)}): {why}", False
            kernel_checks.append(Check(d.path, d.cls, d.op, "kernel", DTYPE_NAMES[dtype], ma, mr, ok, note,
                                       ran_kernel(d, dtype), limit=getattr(verdict, "limit", None), counted=counted))
        if clone is not module:  # its patched forward refers to it, a reference cycle that only the cyclic garbage
            clone.to("meta")     # collector frees, later: its weights are released now (1.7 GiB on a ~1B model)
        del clone
    declared_exact = all(is_exact(r) for _, r in decl_results)
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
        limit = 0.0 if not declared_exact and fits else _tolerance(originals[dtype], dtype)  # bit-exact, or TOLERANCES
        checks.append(Check(d.path, d.cls, d.op, "declaration", DTYPE_NAMES[dtype], ma, mr, passed, note, d.kernel,
                            limit=limit))
    return checks + kernel_checks


def _tolerance(expected: Any, dtype: torch.dtype) -> float:
    """The most a declaration check allows where no alternative is exact: ``atol + rtol * max|original|`` (:data:`TOLERANCES`)."""
    atol, rtol = TOLERANCES.get(dtype, (1e-5, 1e-5))
    scales = [max_abs(t) for t in tensors_of(expected) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    return atol + rtol * max(scales, default=0.0)


def ran_kernel(d: Any, dtype: torch.dtype) -> str:
    """The kernel whose code a kernel check ran in ``dtype``: ``torch`` where a ``compiled`` kernel never compiles.

    Why: ``compiled`` runs the torch reference wherever its measured rule names no row count
    (``engine/_data/compiled_rows.yaml``: never in fp32 on a CPU), so a row saying ``compiled``
    there claimed a kernel that did not run.
    """
    if d.kernel == "compiled" and compiled.rule().get(d.op, {}).get((dtype, False)) is None:
        return "torch"
    return d.kernel


def _as_at_scale(d: Any, dtype: torch.dtype) -> contextlib.AbstractContextManager[None]:
    """The code a larger batch runs, at the probe's size.

    A compiled kernel runs only from the row count its measured rule names
    (``engine/_data/compiled_rows.yaml``; bf16 inference from 1024 rows, say), and a probe is
    smaller: without this, the kernel check would judge the reference and leave the compiled code a
    long batch reaches unverified. Where the rule can never compile (fp32 on CPU), nothing is forced.
    """
    if d.kernel == "compiled" and compiled.rule().get(d.op, {}).get((dtype, False)) is not None:
        return compiled.compiled_from(1)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _original(model: nn.Module | None) -> Iterator[None]:
    """``model`` with every forward original and its package-bound functions on torch (see ``models._original``)."""
    if model is None:
        yield
        return
    with original_forwards(model), torch_path(model):
        yield


def _dtype_of(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return DTYPE_NAMES.get(value.dtype, str(value.dtype))
    return type(value).__name__


def verify_function(d: Any, args: Any, kwargs: Any, low: torch.dtype) -> list[Check]:
    router = routing.router_for(d.site.namespace, d.site.function)
    assert router is not None
    impl = d.provider.build(d.patch)
    checks = []
    wants = {}
    for dtype in (torch.float32, low):
        a, k = cast_floats(args, dtype), cast_floats(kwargs, dtype)
        # The original's torch body: transformers may have bound the name to a package
        # (fla) that does not run on this device; its torch function is the ground truth.
        body = torch_body(router.original)
        with torch.no_grad():
            wants[dtype] = want = body(*a, **k)
            # the kernel on copies: some (liger's rope) rotate contiguous inputs in place
            got = impl(*cast_floats(clone_tensors(a), dtype), **cast_floats(clone_tensors(k), dtype))
        ma, mr, _ = compare(got, want)
        verdict = _judge(got, want, body, clone_tensors(a), clone_tensors(k), None)
        ok, note = verdict
        if not ok:
            note = f"kernel {d.kernel} does not compute what {d.site.function} computes: {note}"
        checks.append(Check(d.path, "function", d.op, "kernel", DTYPE_NAMES[dtype], ma, mr, ok, note, d.kernel,
                            limit=getattr(verdict, "limit", None)))
    if not all(c.passed for c in checks):
        fits = _function_fits(d, args, kwargs, wants)
        if fits:
            declared = _settings(d.patch, _varied_keys(d.patch, [alt for _, alt in get_op(d.op).alternatives(d.patch)]))
            for c in checks:
                if not c.passed:
                    c.note = f"declared {declared} does not compute what {d.site.function} computes; {' or '.join(fits)} fits"
    return checks


def _function_fits(d: Any, args: Any, kwargs: Any, wants: dict[torch.dtype, Any]) -> list[str]:
    """The alternative declarations of a function patch (another rope layout) whose reference is exact."""
    op = get_op(d.op)
    fits = []
    for label, alt in op.alternatives(d.patch):
        reference = op.reference(alt)
        exact = True
        for dtype, want in wants.items():
            a, k = cast_floats(clone_tensors(args), dtype), cast_floats(clone_tensors(kwargs), dtype)
            with torch.no_grad():
                try:
                    exact = exact and is_exact(compare(reference(*a, **k), want))
                except (TypeError, ValueError, RuntimeError):  # a layout whose function takes other arguments
                    exact = False
        if exact:
            fits.append(label)
    return fits


def _judge(
    got: Any, expected: Any, original: Callable[..., Any], args: Any, kwargs: Any, module: nn.Module | None
) -> tuple[bool, str]:
    """Bit-equal, or within the original's own rounding error of it (``original(*args, **kwargs)`` rerun in fp64 tells)."""
    if is_exact(compare(got, expected)):
        return True, ""
    with torch.no_grad(), fp64_truth(module), same_draws(module):
        truth = original(*args, **kwargs)
    return judge(got, expected, truth)


def _unverified_elsewhere(d: Any, dtype: torch.dtype) -> str | None:
    """Why ``d``'s vendor kernel is measured to fail the verifier in ``dtype`` (so ``auto`` picks it only
    in models of another dtype; :mod:`engine.kernels.vendor_dtypes`), or ``None``."""
    from engine.kernels.vendor_dtypes import unverified

    provider = d.provider
    devices = sorted(dev.value for dev in provider.devices) if provider is not None else []
    return next((why for dev in devices if (why := unverified(d.kernel, d.op, dev, dtype)) is not None), None)
