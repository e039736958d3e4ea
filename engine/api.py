"""The public facade: ``engine.apply``, ``plan``, ``verify``, ``revert``, ``is_patched``.

It orchestrates the layers beneath it (plan -> patch -> verify) so that none of them has to
know about the others: the planner decides, the patcher changes the model as a plan says,
verification compares numbers. Only this module combines patching with verification.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from engine import verification, zeroconfig
from engine.errors import InvalidArgument, VerificationFailed, ZeroConfigWarning
from engine.foundation.release_policy import either, resolve_policy
from engine.loader import load_patchset
from engine.patching.patcher import apply as _patch
from engine.patching.patcher import is_patched, revert
from engine.planning.decisions import Plan
from engine.planning.planner import Mode
from engine.planning.planner import plan as _plan
from engine.planning.report import Report
from engine.releases import ReleaseGate
from engine.runtime.wrappers import unwrap
from engine.schema import Device, Patchset
from engine.verification.real_modules import RealModules, check_real_modules
from engine.zeroconfig.tiny_copy import tiny_copy
from engine.zeroconfig.verdict import subset

__all__ = ["apply", "is_patched", "plan", "revert", "verify"]



def verify(model: nn.Module, patchset: Any = None, *, interpret: bool = False, **kwargs: Any) -> Any:
    """:func:`engine.verification.verify` (see there), and with ``interpret=True`` the CUDA plan run on this CPU.

    ``interpret=True`` plans for CUDA (``device`` defaults to ``"cuda"``; another device is an
    error), and runs the vendor kernels that plan picks (liger, fla: Triton code) on the CPU
    tensors of the model with Triton's interpreter, judged exactly as on a GPU: the code a CUDA
    user runs, with the engine's own arguments, on a machine without one. Slow (each Triton
    program runs in Python): a tiny model, or ``modules="sample"`` and a short ``batch``. Only
    this call is interpreted (:func:`engine.kernels.triton_interpret.interpreting`); a model
    patched for CUDA on a CPU runs its vendor kernels only inside such a block.

    Example:
        >>> engine.verify(tiny, "qwen3", device="cuda", interpret=True)   # doctest: +SKIP
    """
    if "unverified" in kwargs or "unverified_release" in kwargs:  # one setting, two names (verify applies unchecked)
        kwargs["unverified_release"] = _policy(kwargs.pop("unverified", None), kwargs.pop("unverified_release", None),
                                               "verify")
    if not interpret:
        return verification.verify(model, patchset, **kwargs)
    from engine.kernels.triton_interpret import interpreting
    from engine.runtime.devices import as_device

    device = as_device(kwargs.pop("device", None) or "cuda")
    if device is not Device.cuda:
        raise InvalidArgument(f"verify(interpret=True) runs the CUDA plan's Triton kernels with Triton's CPU "
                              f"interpreter; device={device.value!r} has no Triton kernels to interpret: use "
                              "device='cuda' (the default with interpret=True)")
    if patchset is not None:
        kwargs["device"] = device
    with interpreting():
        return verification.verify(model, patchset, **kwargs)


def apply(
    model: nn.Module,
    patchset: Patchset | str | dict[str, Any] | None = None,
    *,
    device: str | Device | torch.device | None = None,
    mode: Mode | None = None,
    verify: bool | str | Mapping[str, Any] = False,
    fused_cross_entropy: Any = None,
    unverified: str | None = None,
    unverified_release: str | None = None,
    strict: bool = False,
    check_modules: bool = True,
) -> Report:
    """Patch ``model`` in place with ``patchset``; return what was done.

    No patchset (``None`` or ``"auto"``): zero configuration (:mod:`engine.zeroconfig`): the
    bundled patchset of the model's type where there is one, else declarations measured on a
    tiny copy of the model's own config and classes, verified there (cached) and applied where
    verified; ``"measure"`` measures even where a bundled file exists. ``report.zero_config``
    says what was measured, patched and left unpatched, and why; nothing to patch is a
    :class:`~engine.errors.ZeroConfigWarning` (an error with ``strict=True``, as is a measured
    declaration that failed verification).

    All checks run first (see :func:`engine.plan`); the model changes only if every one
    passes, and any failure while patching restores it. Applying the same patchset twice
    patches once. With ``verify=True`` every patched module is then compared numerically
    with its original forward (see :func:`engine.verify`), and a mismatch reverts the model
    and raises :class:`VerificationFailed` (``exc.report`` has every check). ``verify="sample"``
    checks the first, middle and last module of each patched class only (large models);
    ``verify={"batch": enc, "modules": "sample"}`` passes options to :func:`engine.verify`.

    Example:
        >>> report = engine.apply(model, "qwen3")     # doctest: +SKIP
        >>> engine.revert(model)                      # doctest: +SKIP

    ``fused_cross_entropy=True`` (or ``{"kernel": ..., "chunk_size": ...}``) also fuses the
    causal-LM head + loss of any family (``False`` leaves it off; ``None``, the default, keeps
    the patchset's ``fused_cross_entropy`` key). See :mod:`engine.planning.fused_head`.

    A peft ``PeftModel`` is patched as the transformers model inside it (the state lives
    there), so wrapping before or after patching gives the same model.

    **Nothing unverified patches by default.** Content patches without a verification only where
    it is known verified on the installed transformers: a bundled patchset's content as CI verified
    it on this release (``engine/_data/verified_content.json``), or content with a passing verdict
    of its own in the cache. Anything else (your own file or dict, inside its ``requires`` range or
    not, an edited bundled file, a release CI did not run) gets what ``unverified`` says (unset:
    ``$PATCH_ENGINE_UNVERIFIED``, else ``"verify"``; ``unverified_release``,
    ``$PATCH_ENGINE_UNVERIFIED_RELEASE`` are its old names): ``"verify"`` verifies it first on a
    tiny model of this model's type with the plan's device, dtype, mode and kernels, caches the
    verdict (the next apply reads it), then patches, or raises :class:`SelfVerificationFailed`
    (:class:`ReleaseVerificationFailed` outside the range) with the finding and the ``file:line``
    of the patch that does not fit; a verification that could not run raises
    :class:`VerificationNotRun` and caches nothing. ``"refuse"`` refuses it
    (:class:`UnverifiedContent`; a release outside the range: :class:`VersionMismatch`);
    ``"trust"`` patches with a warning. :func:`plan` says which way it goes; the report's
    ``release`` keeps the verdict (:mod:`engine.releases`). With ``verify=...`` the verification
    of this model itself stands for it (no tiny model is built).

    **Checked on your own modules** (``check_modules=True``, the default): once installed, each
    patched class is also compared, original forward against patched forward (and backward in
    training), on one of this model's own instances per parameter shape: its weights, width, dtype
    and device, at 1, 17 and 129 rows (:mod:`engine.verification.real_modules`; ops with hidden-state
    inputs; cached for the process). A difference beyond the original's own rounding error reverts
    the model and raises :class:`VerificationFailed` naming the module's path, class, patch, dtype,
    length and difference; with zero configuration the failing patches are left unpatched instead
    (``report.zero_config.not_patched``, a :class:`~engine.errors.ZeroConfigWarning`; an error with
    ``strict=True``). ``report.real_modules`` says what was checked and what was not, and why.
    With ``verify=...`` it runs after that verification (whose report, on a failure, says more).
    ``unverified="trust"`` and ``check_modules=False`` skip it.
    """
    options = _verify_options(verify)  # bad options fail before the model changes
    policy = _policy(unverified, unverified_release, "apply")
    choice = None
    if zeroconfig.is_zero_config(patchset):  # no patchset named: bundled for its type, else measured and verified
        choice = zeroconfig.choose(model, patchset, device=device, mode=mode, fused_cross_entropy=fused_cross_entropy,
                                   strict=strict)
        if choice.patchset is None:  # nothing verified to patch: the model is left as it is (a warning said so)
            assert choice.empty is not None
            return choice.empty
        patchset = choice.patchset
    was_patched = is_patched(model)
    # with verify=..., this model's own verification vouches for an unverified release (no tiny model);
    # measured declarations were verified on the tiny copy of this model already (engine.zeroconfig.verdict)
    gate: Any = (choice.gate if choice is not None and choice.gate is not None
                 else ReleaseGate(unwrap(model), verified_after=options is not None, policy=policy,
                                  tiny_copy=tiny_copy))
    report = _patch(model, patchset, device=device, mode=mode, fused_cross_entropy=fused_cross_entropy,
                    unverified_release=policy, before_install=gate)
    if gate.outcome is not None:
        report.release = gate.outcome
    if options is not None:  # this model's own verification first: its report says what it found, as always
        _verify_model(model, report, options, gate, was_patched)
    if not check_modules or policy == "trust":
        report.real_modules = RealModules(skipped="check_modules=False" if not check_modules else
                                          "unverified='trust': patched as given")
    else:
        checked = _own_modules(model, report, choice, patchset, strict=strict, device=device, mode=mode,
                               fused_cross_entropy=fused_cross_entropy, unverified_release=policy)
        if checked is not report and options is not None:  # fewer patches now (zero configuration): verified again
            _verify_model(model, checked, options, _Unrecorded(), was_patched)  # a part of the content: no verdict
        report = checked
    if choice is not None:
        report.zero_config = choice.record
    return report



class _Unrecorded:
    """A gate's verdict hooks that record nothing (a re-verification of a part of a patchset's content)."""

    def passed_on_model(self, report: Any) -> None:
        """Nothing recorded: the content verified is not the content the gate knows."""

    def failed_on_model(self, error: Exception) -> None:
        """Nothing recorded: the error names the module."""


def _verify_model(model: nn.Module, report: Report, options: dict[str, Any], gate: Any, was_patched: bool) -> None:
    """``apply(verify=...)``: this model verified as patched; a failure reverts it and raises."""
    if report.verification is not None:  # a repeat that changed nothing keeps its verification
        return
    try:
        # the conditions of use within apply's budget (engine/_data/conditions.yaml); engine.verify(model) runs all
        report.verification = verification.verify(model, raise_on_failure=True, **{"conditions": "budget", **options})
    except VerificationFailed as exc:
        revert(model)
        gate.failed_on_model(exc)
        raise
    except Exception:  # verification could not run (a bad batch): the model is as it was before this call
        if not was_patched:
            revert(model)
        raise
    gate.passed_on_model(report)


def _own_modules(model: nn.Module, report: Report, choice: Any, patchset: Any, *, strict: bool,
                 **apply_kwargs: Any) -> Report:
    """The real-module check of an installed plan: the report, or a refusal (named) / a smaller patchset (zero config).

    Named patchset (or ``strict``): any failure reverts the model and raises. Zero configuration
    asked for what fits this model, so a failing patch is dropped instead: the model is reverted
    and re-patched with the other patches (:func:`engine.zeroconfig.verdict.subset`), without the
    release gate, which has passed the whole patchset and a part of it the same; the re-patched
    model is checked again (read from the in-process cache).
    """
    found = check_real_modules(model, report)
    report.real_modules = found
    if found.passed:
        return report
    revert(model)
    if choice is None or strict:
        raise VerificationFailed(found.message())
    loaded = patchset if isinstance(patchset, Patchset) else load_patchset(patchset)
    failed = found.failed_patches()
    dropped = [f"{m.cls}: {m.op}: not patched, failed the check on your own module: {m.finding()}"
               for m in found.failed]
    warnings.warn("patch-engine: " + "; ".join(dropped), ZeroConfigWarning, stacklevel=3)
    choice.record.not_patched += dropped
    keep = [i for i in range(len(loaded.patches)) if i not in failed]
    found.left_unpatched = dropped
    if not keep:  # nothing left: the model as it was, and the report of an empty plan
        empty = Report.from_plan(_plan(model, subset(loaded, []), device=apply_kwargs["device"],
                                       mode=apply_kwargs["mode"], fused_cross_entropy=False))
        empty.release, empty.real_modules = report.release, found
        return empty
    again = _patch(model, subset(loaded, keep), **apply_kwargs)
    again.release = report.release
    checked = check_real_modules(model, again)
    if not checked.passed:  # what is left computes what it should on its own; anything else is a bug here
        revert(model)
        raise VerificationFailed(checked.message())
    checked.left_unpatched = dropped
    again.real_modules = checked
    return again


def plan(
    model: nn.Module,
    patchset: Patchset | str | dict[str, Any],
    *,
    device: str | Device | torch.device | None = None,
    mode: Mode | None = None,
    fused_cross_entropy: Any = None,
    unverified: str | None = None,
    unverified_release: str | None = None,
) -> Plan:
    """What :func:`apply` would do (:func:`engine.planning.planner.plan`, see there), and how it is verified.

    ``Plan.verification`` (a line of ``str(plan)``) says which way apply goes: no verification
    needed (bundled content CI verified on this release), a cached verdict of its own, a
    verification first, trusted or refused (``unverified``, as for :func:`apply`). Nothing is
    changed, verified or written.
    """
    from dataclasses import replace

    from engine.releases.known import verification_path
    from engine.runtime.wrappers import unwrap

    policy = _policy(unverified, unverified_release, "plan")
    the_plan = _plan(model, patchset, device=device, mode=mode, fused_cross_entropy=fused_cross_entropy,
                     unverified_release=policy)
    return replace(the_plan, verification=verification_path(unwrap(model), the_plan, policy))


def _policy(unverified: str | None, unverified_release: str | None, call: str) -> Any:
    """The one policy from the setting's name or its old name (each named as written when it is bad)."""
    value = either(unverified, unverified_release, where=f"{call}(): ")
    name = "unverified" if unverified is not None else "unverified_release"
    return resolve_policy(value, setting=name)


_VERIFY_OPTIONS = ("batch", "modules", "check_model", "progress", "conditions")


def _verify_options(verify: bool | str | Mapping[str, Any]) -> dict[str, Any] | None:
    """``apply(verify=...)`` as keyword arguments of :func:`engine.verify`, or ``None`` for no verification."""
    if verify is False or verify is None:
        return None
    if verify is True:
        return {}
    if verify in ("all", "sample"):
        return {"modules": verify}
    if isinstance(verify, Mapping):
        unknown = sorted(set(verify) - set(_VERIFY_OPTIONS))
        if unknown:
            raise ValueError(f"apply(verify=...): unknown option(s) {unknown}; the options are {list(_VERIFY_OPTIONS)}")
        return dict(verify)
    raise ValueError(f"apply(verify={verify!r}): expected True, False, 'all', 'sample', or a dict of "
                     f"engine.verify options ({', '.join(_VERIFY_OPTIONS)})")
