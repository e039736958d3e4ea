"""Zero configuration: ``engine.apply(model)`` with no patchset named.

What it does, in order (DESIGN.md: "zero configuration is measured declarations through the
same gate"):

1. **The bundled patchset of the model's type**, where there is one
   (:func:`engine.zeroconfig.bundled.bundled_for`; never for remote code). It goes through
   ``apply`` as if it had been named.
2. **Otherwise declarations measured** on a tiny copy of the model built from its *own* config
   and classes (:mod:`.tiny_copy`, :mod:`.measure`: the scaffold's measurement of every op),
   as an in-memory patchset: data, like a user's file. ``"measure"`` forces this path on a type
   that has a bundled patchset.
3. **Verified** on that tiny copy by the same judge and in the same verdict cache as a user's
   file (:mod:`.verdict`), with the kernels the plan chose for the user's model; a declaration
   that fails is left unpatched with its finding, never applied.
4. **A report** (:class:`ZeroConfigReport`, on ``Report.zero_config``) of what was measured,
   patched and left unpatched, and why. Nothing is refused silently: a model with nothing to
   patch gets a :class:`~engine.errors.ZeroConfigWarning`, not an error, unless ``strict``.

No declaration is guessed from a class's name or weights: what is not measured exact is not patched.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from engine.errors import InvalidArgument, TargetNotFound, VerificationFailed, ZeroConfigWarning
from engine.planning.decisions import Plan
from engine.planning.planner import plan
from engine.planning.report import Report
from engine.runtime.wrappers import unwrap
from engine.schema import Patchset
from engine.zeroconfig.bundled import bundled_for
from engine.zeroconfig.measure import Measured, measure
from engine.zeroconfig.tiny_copy import code_identity
from engine.zeroconfig.verdict import MeasuredVerdict, subset, verified_subset

__all__ = ["AUTO", "MEASURE", "Choice", "ZeroConfigReport", "choose", "is_zero_config", "resolve"]

#: ``apply(model, "auto")`` is ``apply(model)``; ``apply(model, "measure")`` measures even where a bundled file exists.
AUTO, MEASURE = "auto", "measure"


def is_zero_config(patchset: Any) -> bool:
    """Whether ``apply``'s patchset argument asks for zero configuration (``None``, ``"auto"``, ``"measure"``)."""
    return patchset is None or (isinstance(patchset, str) and patchset in (AUTO, MEASURE))


def _label(patch: Any) -> str:
    """``Qwen3RMSNorm: rms_norm (scale: weight, cast: llama)``: the settings that say what it computes."""
    from engine.ops.base import get_op
    from engine.scaffolding.rendering import settings_text

    what = getattr(patch, "target", None) or getattr(patch, "function", None)
    fields = type(patch).model_fields
    data = patch.model_dump(mode="json")
    keys = [k for k in data if k in get_op(patch.op).declared_settings
            or (k in fields and k not in ("target", "function", "op", "kernel", "when")
                and data[k] != getattr(fields[k].default, "value", fields[k].default))]
    return f"{what}: {patch.op} ({settings_text(patch, keys)})"


@dataclass
class ZeroConfigReport:
    """What zero configuration chose for one model, and why: bundled, or measured (what, verified, left out)."""

    source: str  # "bundled" or "measured"
    model_type: str
    model_class: str
    bundled: str | None = None
    measured: list[str] = field(default_factory=list)  # every exact declaration: "Qwen3MLP: swiglu (defaults)"
    patched: list[str] = field(default_factory=list)  # those verified and applied
    failed: dict[str, str] = field(default_factory=dict)  # declaration -> the verifier's finding (not applied)
    not_patched: list[str] = field(default_factory=list)  # the scaffold's lines: class (modules): why
    problem: str = ""  # why nothing could be measured or verified
    measure_seconds: float = 0.0
    measure_cached: bool = False
    measure_cache_file: str | None = None
    verdict: dict[str, Any] | None = None  # checks, seconds, device, dtype, mode, cached, cache_file
    bundled_misfit: str = ""  # why the bundled patchset of its type was not used ("" when there is none, or it fit)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        if self.source == "bundled":
            return f"zero configuration: the bundled patchset {self.bundled!r} of {self.model_type}"
        return (f"zero configuration: measured on a tiny copy of {self.model_class}: {len(self.measured)} declarations, "
                f"{len(self.patched)} verified and applied, {len(self.failed)} failed verification")

    def __str__(self) -> str:
        if self.source == "bundled":
            return (f"{self.summary()} (no patchset named; measured, read and verified in CI, so it is used as named; "
                    "engine.apply(model, 'measure') measures instead)")
        how = f"read from {self.measure_cache_file}" if self.measure_cached else f"in {self.measure_seconds} s"
        lines = [f"{self.summary()}; measured {how}"]
        if self.bundled_misfit:
            lines.append(f"  {self.bundled_misfit}")
        if self.problem:
            lines.append(f"  nothing patched: {self.problem}")
        if self.verdict:
            v = self.verdict
            where = f"verdict read from {v['cache_file']}" if v["cached"] else (
                f"verdict cached in {v['cache_file']}" if v["cache_file"] else "verdict not cached")
            lines.append(f"  verified on the tiny copy ({v['device']}, {v['dtype']}, {v['mode']}): {v['checks']} checks "
                         f"in {v['seconds']} s; {where}")
        lines += [f"  patched: {p}" for p in self.patched]
        lines += [f"  not patched, not verified on the tiny copy: {d}: {why}" for d, why in self.failed.items()]
        lines += [f"  not patched: {line}" for line in self.not_patched]
        return "\n".join(lines)


class MeasuredGate:
    """``before_install`` for a verified measured patchset: the plan must install the kernels that were verified."""

    def __init__(self, kernels: dict[str, list[str]]):
        self.kernels = kernels
        self.outcome = None

    def __call__(self, the_plan: Plan) -> None:
        from engine.releases.self_verify import kernels_of

        if kernels_of(the_plan) != self.kernels:
            raise VerificationFailed(f"the plan installs other kernels ({kernels_of(the_plan)}) than the measured "
                                     f"declarations were verified with ({self.kernels}); nothing was patched")

    def passed_on_model(self, report: Any) -> None:
        """Nothing to add: the model's own verification stands for itself."""

    def failed_on_model(self, error: Exception) -> None:
        """Nothing to add: the error names the module."""


@dataclass
class Choice:
    """What ``apply`` patches with: a bundled name, a verified measured patchset, or nothing (``empty``)."""

    record: ZeroConfigReport
    patchset: Patchset | str | None  # None: nothing to patch (``empty`` is the report)
    gate: MeasuredGate | None = None
    empty: Report | None = None


def _nothing(record: ZeroConfigReport, model: nn.Module, strict: bool, **plan_kwargs: Any) -> Choice:
    why = record.problem or "no op of the engine computes any of its modules or functions exactly"
    message = f"patch-engine: engine.apply(model) patched nothing on this {record.model_class}: {why}"
    if strict:
        raise TargetNotFound(message)
    warnings.warn(message, ZeroConfigWarning, stacklevel=4)
    name = f"{record.model_type or 'model'}.measured"
    empty = Report.from_plan(plan(model, {"name": _safe(name), "model_types": [record.model_type], "patches": []},
                                  **plan_kwargs))
    empty.zero_config = record
    return Choice(record, None, empty=empty)


def _misfit(model: nn.Module, bundled: str, **plan_kwargs: Any) -> str:
    """Why the bundled patchset of the model's type does not fit this model (``""``: it fits).

    Why: a bundled file is written for the released checkpoints' configs; a model of the same
    type built with another config (Mistral 3's default vision tower runs GELU where the
    checkpoints run SiLU) makes its plan refuse a declaration. Named, that refusal is right;
    with no patchset named, the user asked for what fits, so the model is measured instead, and
    the report says why.
    """
    from engine.errors import SignatureMismatch

    try:
        plan(model, bundled, **plan_kwargs)
    except (SignatureMismatch, TargetNotFound) as exc:
        return f"the bundled patchset {bundled!r} does not fit this model's config ({exc}), so it was measured instead"
    return ""


def _other_code(model: nn.Module, bundled: str, **plan_kwargs: Any) -> str:
    """Why the bundled patchset does not vouch for this model's code (``""``: CI verified it on exactly this code).

    Why measure then: the bundled file was verified on transformers' classes as CI ran them; a class
    rebound in Python, an edited install or a same-named class of the user's computes something
    else, and with no patchset named the user asked for what fits the code they run. Where CI did
    not run this release at all, the bundled file goes through the release gate as before.
    """
    from engine.releases.code import code_not_verified, shown

    differs = code_not_verified(model, plan(model, bundled, **plan_kwargs))
    if not differs:  # the same code, or a release CI did not run (the release gate verifies it then)
        return ""
    return (f"the bundled patchset {bundled!r} was verified by CI on other code than this model runs ({shown(differs)}: "
            "changed in Python, an edited install, or a class of another module), so this model was measured instead")


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "_.-" else "_" for c in name) or "measured"


def choose(
    model: nn.Module, patchset: Any = None, *, device: Any = None, mode: Any = None, fused_cross_entropy: Any = None,
    strict: bool = False,
) -> Choice:
    """The patchset ``engine.apply(model)`` uses (see the module docstring); measures and verifies where needed."""
    if not is_zero_config(patchset):
        raise InvalidArgument(f"zero configuration takes None, {AUTO!r} or {MEASURE!r}, not {patchset!r}")
    inner = unwrap(model)
    model_type = str(getattr(getattr(inner, "config", None), "model_type", "") or "")
    record = ZeroConfigReport("measured", model_type, type(inner).__name__)
    bundled = bundled_for(inner) if patchset != MEASURE else None
    plan_kwargs = {"device": device, "mode": mode}
    if bundled is not None:
        misfit = _misfit(inner, bundled, fused_cross_entropy=fused_cross_entropy, **plan_kwargs)
        misfit = misfit or _other_code(inner, bundled, fused_cross_entropy=fused_cross_entropy, **plan_kwargs)
        if not misfit:
            record.source, record.bundled = "bundled", bundled
            return Choice(record, bundled)
        record.bundled_misfit = misfit  # a config the bundled file was not written for: measured instead
    identity = code_identity(inner)  # what both cache keys hold of the model: its classes, code and shrunk config
    found: Measured = measure(inner, identity)
    record.measure_seconds, record.measure_cached, record.measure_cache_file = (
        found.seconds, found.cached, found.cache_file)
    record.not_patched, record.problem = list(found.not_patched), found.problem
    if found.patchset is None or not found.patchset.patches:
        return _nothing(record, inner, strict, **plan_kwargs)
    measured = found.patchset
    record.measured = [_label(p) for p in measured.patches]
    the_plan = plan(inner, measured, fused_cross_entropy=fused_cross_entropy, **plan_kwargs)
    verdict: MeasuredVerdict = verified_subset(inner, measured, the_plan, fused_cross_entropy=fused_cross_entropy,
                                               identity=identity)
    record.verdict = {"checks": verdict.checks, "seconds": verdict.seconds, "device": verdict.device,
                      "dtype": verdict.dtype, "mode": verdict.mode, "cached": verdict.cached,
                      "cache_file": verdict.cache_file}
    record.failed = {record.measured[i]: why for i, why in sorted(verdict.failed.items())}
    record.problem = record.problem or verdict.problem
    unplanned = sorted(set(range(len(measured.patches))) - {d.patch_index for d in the_plan.patched})
    record.not_patched += [f"{record.measured[i]}: planned no module on this model" for i in unplanned]
    if strict and (record.failed or record.problem):
        detail = "\n".join(f"{d}: {why}" for d, why in record.failed.items()) or record.problem
        raise VerificationFailed(f"patch-engine: measured declarations of {record.model_class} failed verification "
                                 f"on its tiny copy (strict=True, so nothing was patched):\n{detail}")
    if not verdict.passed:
        return _nothing(record, inner, strict, **plan_kwargs)
    record.patched = [record.measured[i] for i in verdict.passed]
    if record.failed:
        warnings.warn(f"patch-engine: {len(record.failed)} measured declaration(s) of {record.model_class} failed "
                      f"verification and were left unpatched: {', '.join(record.failed)}", ZeroConfigWarning,
                      stacklevel=4)
    from engine.releases.self_verify import kernels_of

    verified = kernels_of(the_plan)  # the kept patches' kernels, renumbered as the kept patchset numbers them
    kernels = {str(j): verified[str(i)] for j, i in enumerate(verdict.passed) if str(i) in verified}
    return Choice(record, subset(measured, verdict.passed), gate=MeasuredGate(kernels))


def resolve(model: nn.Module, patchset: Any, **kwargs: Any) -> Patchset | str | dict[str, Any] | None:
    """``patchset`` itself, or for zero configuration the one ``apply`` would use (``None``: nothing to patch).

    For a caller that must plan before applying (a launcher's checks); the measurement and its
    verdict are cached, so the apply that follows reads them.
    """
    if not is_zero_config(patchset):
        return patchset
    with warnings.catch_warnings():  # the apply that follows warns
        warnings.simplefilter("ignore", ZeroConfigWarning)
        return choose(model, patchset, **kwargs).patchset
