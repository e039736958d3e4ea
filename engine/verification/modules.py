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
from collections.abc import Callable, Collection, Iterator, Sequence
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
    Judged,
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
from engine.verification.truth_sink import GradientSink

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
    own = next(module.parameters(), torch.empty(0)).dtype
    dtypes = (own,) if within is not None else (torch.float32, low)
    return verify_module_inputs(d, module, [(args, kwargs)], dtypes, within=within)[0]


def verify_module_inputs(
    d: Any, module: nn.Module, inputs: Sequence[tuple[Any, Any]], dtypes: Sequence[torch.dtype], *,
    within: nn.Module | None = None, in_place: bool = False, at_scale: bool = True, lean: bool = False,
    backward_on: Collection[int] = (),
) -> list[list[Check]]:
    """:func:`verify_module` on several input sets, one list of checks per set (in ``inputs``' order).

    Why several: a module checked at a few lengths (the real-module check,
    :mod:`engine.verification.real_modules`) makes its cast copy once per dtype, not once per length.
    ``in_place``: the dtype the module already has runs on the module itself (no copy; nothing
    writes its ``.grad``). ``at_scale=False``: a ``compiled`` kernel is judged as these inputs run it
    (the reference below its measured row count) instead of compiled from one row, which costs a
    compilation. ``lean``: the installed forward is always compared with the original, and the
    declaration and its alternatives run only where it is not bit-equal (to say why); a bit-equal
    installed forward is the declaration reproducing the original. ``backward_on``: the input sets
    whose gradients (of the floating inputs and trainable parameters) are compared too, patched
    against original, judged against an fp64 truth (a ``backward`` check per dtype).
    """
    op = get_op(d.op)
    assert isinstance(op, ModuleOp)
    alternatives = list(op.module_alternatives(d.patch, module))
    own = next(module.parameters(), torch.empty(0)).dtype
    runs = [_Run({label: True for label, _ in alternatives}) for _ in inputs]
    for dtype in dtypes:
        copied = within is None and not (in_place and dtype == own)
        clone = _cast_copy(module, dtype) if copied else module
        try:
            for i, (run, (args, kwargs)) in enumerate(zip(runs, inputs, strict=True)):
                _run_dtype(d, op, clone, args, kwargs, dtype, own, alternatives, run, within, at_scale, lean)
                if i in backward_on and within is None:
                    run.kernel.append(_backward_check(d, op, clone, args, kwargs, dtype, own, at_scale))
        finally:
            if copied:  # its patched forward refers to it, a reference cycle that only the cyclic garbage
                clone.to("meta")  # collector frees, later: its weights are released now (1.7 GiB on a ~1B model)
            del clone
    declared_text = _settings(d.patch, _varied_keys(d.patch, [alt for _, alt in alternatives]))
    return [_declaration_checks(d, run, declared_text) + run.kernel for run in runs]


class _Run:
    """What one input set measured across the dtypes, before it becomes checks."""

    def __init__(self, alt_exact: dict[str, bool]):
        self.alt_exact = alt_exact
        self.declared: list[tuple[torch.dtype, tuple[float, float, bool]]] = []
        self.declared_out: dict[torch.dtype, Any] = {}
        self.originals: dict[torch.dtype, Any] = {}
        self.kernel: list[Check] = []


def _cast_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A deep copy of ``module`` with its floating parameters and buffers in ``dtype``, each made cast.

    Why not ``deepcopy(module).to(dtype)``: that holds a full copy in the module's own dtype
    before the cast one (an fp32 copy, then bf16: 1.5 times the bf16 copy at its peak).
    """
    memo: dict[int, Any] = {}
    for p in module.parameters():  # a parameter of a subclass (a quantized one) is left to deepcopy and .to
        if type(p) is nn.Parameter and p.is_floating_point() and p.dtype != dtype:
            cast = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            cast.__dict__.update(p.__dict__)
            memo[id(p)] = cast
    for b in module.buffers():
        if type(b) is torch.Tensor and b.is_floating_point() and b.dtype != dtype:
            memo[id(b)] = b.detach().to(dtype)
    return copy.deepcopy(module, memo).to(dtype)


def _run_dtype(d: Any, op: ModuleOp, clone: nn.Module, args: Any, kwargs: Any, dtype: torch.dtype,
               own: torch.dtype, alternatives: list[tuple[str, Any]], run: _Run, within: nn.Module | None,
               at_scale: bool, lean: bool) -> None:
    """One input set in one dtype: the declaration, each alternative and (unless ``within``) the kernel."""
    a, k = cast_floats(args, dtype), cast_floats(kwargs, dtype)
    with torch.no_grad(), _original(within), same_draws(clone):  # the same dropout masks in each run (LoRA's)
        expected = op.ground_truth(clone)(clone, *a, **k)
    got = None
    if within is None and (lean or d.kernel != "torch"):  # the torch kernel *is* the declaration, checked below
        with torch.no_grad(), same_draws(clone), _as_at_scale(d, dtype, at_scale):
            got = clone.forward(*a, **k)
    differs = _compare(got, expected) if got is not None else None
    if not (lean and differs is not None and is_exact(differs)):
        with torch.no_grad(), _original(within):
            with same_draws(clone):
                declared = op.bind(clone, d.patch, op.reference(d.patch))(clone, *a, **k)
            run.declared.append((dtype, compare(declared, expected)))
            run.declared_out[dtype], run.originals[dtype] = declared, expected
            for label, alt in alternatives:
                with same_draws(clone):
                    other = op.bind(clone, alt, op.reference(alt))(clone, *a, **k)
                run.alt_exact[label] = run.alt_exact[label] and is_exact(compare(other, expected))
    if got is None or differs is None:
        return
    ma, mr, _ = differs
    verdict = Judged(True, "") if is_exact(differs) else _judge(got, expected, op.ground_truth(clone), (clone, *a), k,
                                                                  clone)
    ok, note, counted = _counted(d, verdict, dtype, own)
    run.kernel.append(Check(d.path, d.cls, d.op, "kernel", DTYPE_NAMES[dtype], ma, mr, ok, note,
                            _ran(d, dtype, at_scale), limit=getattr(verdict, "limit", None), counted=counted))


def _compare(got: Any, expected: Any) -> tuple[float, float, bool]:
    """:func:`compare`, with bit-equal tensors found by ``torch.equal`` first (a fraction of its passes)."""
    pairs = list(zip(tensors_of(got), tensors_of(expected), strict=False))
    if len(tensors_of(got)) == len(pairs) == len(tensors_of(expected)) and all(
            isinstance(g, torch.Tensor) and isinstance(e, torch.Tensor) and g.dtype == e.dtype
            and g.shape == e.shape and torch.equal(g, e) for g, e in pairs):
        return 0.0, 0.0, True
    return compare(got, expected)


def _counted(d: Any, verdict: tuple[bool, str], dtype: torch.dtype, own: torch.dtype) -> tuple[bool, str, bool]:
    """``(passed, note, counted)``: the verdict, or shown but not counted where the vendor kernel is measured
    to fail in ``dtype`` and the model does not run it."""
    ok, note = verdict
    if not ok and dtype != own and (why := _unverified_elsewhere(d, dtype)) is not None:
        return True, f"not counted (the model is {DTYPE_NAMES.get(own, own)}): {why}", False
    return ok, note, True


def _ran(d: Any, dtype: torch.dtype, at_scale: bool) -> str:
    """The kernel whose code ran: :func:`ran_kernel`, and ``torch`` for ``compiled`` not forced at scale."""
    return "torch" if d.kernel == "compiled" and not at_scale else ran_kernel(d, dtype)


def _declaration_checks(d: Any, run: _Run, declared_text: str) -> list[Check]:
    declared_exact = all(is_exact(r) for _, r in run.declared)
    fits = [label for label, exact in run.alt_exact.items() if exact]
    checks = []
    for dtype, (ma, mr, ok) in run.declared:
        note, passed = "", ok
        if not declared_exact and fits:
            passed = False
            note = f"declared {declared_text} does not reproduce {d.cls}.forward; {' or '.join(fits)} fits"
        elif not ok:
            tried = ", nor does any alternative" if run.alt_exact else ""
            mine, theirs = _dtype_of(run.declared_out[dtype]), _dtype_of(run.originals[dtype])
            kind = "" if mine == theirs else f" (returns {mine} where the original returns {theirs})"
            note = f"declared {declared_text} does not reproduce {d.cls}.forward{kind}{tried}; is this the right op?"
        # bit-exact where another declaration is, else TOLERANCES
        limit = 0.0 if not declared_exact and fits else _tolerance(run.originals[dtype], dtype)
        checks.append(Check(d.path, d.cls, d.op, "declaration", DTYPE_NAMES[dtype], ma, mr, passed, note, d.kernel,
                            limit=limit))
    return checks


def _backward_check(d: Any, op: ModuleOp, clone: nn.Module, args: Any, kwargs: Any, dtype: torch.dtype,
                    own: torch.dtype, at_scale: bool) -> Check:
    """Gradients of the floating inputs and of the module's own trainable parameters, patched vs original.

    The same upstream gradient (seeded) goes into both; ``torch.autograd.grad`` returns them
    without touching any ``.grad`` (the module may be the user's own). Judged against an fp64 truth
    (the original forward under :class:`~engine.verification.truth.fp64_truth` with fp64 inputs, its
    parameter gradients from the sink, never from ``.grad`` either) where they are not bit-equal.
    A child's parameters (an MLP's projections) are left out: their gradients are the child's own
    autograd of the gradient the kernel hands it, which reaches the input's gradient too, and
    comparing them costs a copy of each weight (three 1024 x 3072 matrices on a 0.6B-sized MLP).
    """
    a, k = cast_floats(args, dtype), cast_floats(kwargs, dtype)
    params = dict(clone.named_parameters(recurse=False))
    names = [n for n, p in params.items() if p.requires_grad and p.is_floating_point()]
    floating = [i for i, t in enumerate(a) if isinstance(t, torch.Tensor) and t.is_floating_point()]

    def grads(call: Callable[..., Any], values: tuple[Any, ...]) -> list[torch.Tensor | None] | None:
        leaves = [values[i].detach().requires_grad_() for i in floating]
        given = list(values)
        for i, leaf in zip(floating, leaves, strict=True):
            given[i] = leaf
        with torch.enable_grad(), same_draws(clone):
            out = call(*given, **k)
        if not isinstance(out, torch.Tensor) or not out.requires_grad:
            return None
        upstream = _upstream(out)
        found = torch.autograd.grad(out, [*leaves, *(params[n] for n in names)], upstream, allow_unused=True)
        return [g.detach() if g is not None else None for g in found]

    original = grads(lambda *x, **kw: op.ground_truth(clone)(clone, *x, **kw), a)
    with _as_at_scale(d, dtype, at_scale):
        patched = grads(lambda *x, **kw: clone.forward(*x, **kw), a)
    if original is None or patched is None:
        return Check(d.path, d.cls, d.op, "backward", DTYPE_NAMES[dtype], 0.0, 0.0, True,
                     "no gradient to compare (the output is not one tensor with a gradient)", _ran(d, dtype, at_scale))
    used = [i for i, (p, o) in enumerate(zip(patched, original, strict=True)) if not (p is None and o is None)]
    if any(patched[i] is None or original[i] is None for i in used):
        return Check(d.path, d.cls, d.op, "backward", DTYPE_NAMES[dtype], float("inf"), float("inf"), False,
                     "the patched and the original forward give gradients to different tensors",
                     _ran(d, dtype, at_scale))
    got, want = [patched[i] for i in used], [original[i] for i in used]
    differs = _compare(got, want)
    ma, mr, _ = differs
    verdict: tuple[bool, str] = (True, "")
    if not is_exact(differs):  # only then the fp64 truth says how far the original itself is
        truth = _truth_grads(op, clone, a, k, floating, names)
        verdict = judge(got, want, [truth[i] for i in used])
    ok, note, counted = _counted(d, verdict, dtype, own)
    return Check(d.path, d.cls, d.op, "backward", DTYPE_NAMES[dtype], ma, mr, ok, note, _ran(d, dtype, at_scale),
                 limit=getattr(verdict, "limit", None), counted=counted)


def _upstream(out: torch.Tensor) -> torch.Tensor:
    """A fixed random upstream gradient of ``out``'s shape (its own generator: no random state moves)."""
    gen = torch.Generator().manual_seed(1234)
    return torch.randn(out.shape, generator=gen, dtype=torch.float32).to(device=out.device, dtype=out.dtype)


def _truth_grads(op: ModuleOp, clone: nn.Module, a: tuple[Any, ...], k: Any, floating: list[int],
                 names: list[str]) -> list[torch.Tensor | None]:
    """The original's gradients in fp64: inputs as fp64 leaves, parameters through the truth's sink."""
    found: dict[str, torch.Tensor] = {}
    sink = GradientSink(lambda name, grad: found.__setitem__(name, grad))
    given = list(a)
    leaves = [a[i].detach().to(torch.float64).requires_grad_() for i in floating]
    for i, leaf in zip(floating, leaves, strict=True):
        given[i] = leaf
    with torch.enable_grad(), fp64_truth(clone, sink), same_draws(clone):
        out = op.ground_truth(clone)(clone, *given, **k)
    out.backward(_upstream(out).to(torch.float64))  # drawn outside the mode, which would draw it in fp64
    sink.flush()
    return [leaf.grad for leaf in leaves] + [found.get(n) for n in names]


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


def _as_at_scale(d: Any, dtype: torch.dtype, at_scale: bool = True) -> contextlib.AbstractContextManager[None]:
    """The code a larger batch runs, at the probe's size.

    A compiled kernel runs only from the row count its measured rule names
    (``engine/_data/compiled_rows.yaml``; bf16 inference from 1024 rows, say), and a probe is
    smaller: without this, the kernel check would judge the reference and leave the compiled code a
    long batch reaches unverified. Where the rule can never compile (fp32 on CPU), nothing is forced.
    """
    if at_scale and d.kernel == "compiled" and compiled.rule().get(d.op, {}).get((dtype, False)) is not None:
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
