"""The gate: what :func:`engine.apply` does between planning and patching about content not known verified.

:func:`engine.releases.known.verification_path` says which way the plan goes; the gate acts on
it before anything changes:

* known verified (bundled content CI verified on this release, a cached pass of its own, nothing
  to patch): the patch goes on;
* ``trust``: warns (:class:`UnverifiedContentWarning`, :class:`UnverifiedReleaseWarning` for a
  release outside the range) and lets the patch go on;
* ``refuse``: :class:`UnverifiedContent`;
* ``verify`` (the default): verifies the content on this release (:mod:`engine.releases.self_verify`,
  a tiny model of the user's model type) under the key's lock and caches the verdict. Passed: one
  warning naming what was verified and where the verdict is kept, and the patch goes on. Failed:
  :class:`SelfVerificationFailed` (:class:`ReleaseVerificationFailed` outside the range) with the
  verifier's finding and the ``file:line`` of each patch that does not fit; the model is untouched.
  Could not run (an exception, no check): :class:`VerificationNotRun` with its cause, nothing
  cached, nothing patched.

Every command a message suggests works as printed: a user's file is named by its absolute path
(:func:`engine.runtime.release.verify_command`), a dict by the Python call that verifies it.
"""

from __future__ import annotations

import datetime
import logging
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from engine.errors import (
    ReleaseVerificationFailed,
    SelfVerificationFailed,
    UnverifiedContent,
    UnverifiedContentWarning,
    UnverifiedReleaseWarning,
    VerificationNotRun,
)
from engine.foundation.release_policy import OutsideRange, Policy, resolve_policy
from engine.planning.decisions import Plan
from engine.releases.cache import VerdictStore
from engine.releases.known import VerificationPath, key_for, model_dtype, verification_path
from engine.releases.self_verify import verify_on_this_release
from engine.releases.verdict import ReleaseVerdict
from engine.runtime.release import verify_command

__all__ = ["LOG", "ReleaseGate", "ReleaseVerdict", "release_verdict"]

#: Where a passed self-verification is said (an info line: it is news, not a warning).
LOG = logging.getLogger("engine.releases")


def _spec(plan: Plan) -> str:
    requires = plan.patchset.requires
    return str(requires.transformers) if requires is not None and requires.transformers else ""


def release_verdict(model: nn.Module, plan: Plan, why: str = "", *,
                    tiny_copy: Callable[[nn.Module], nn.Module] | None = None) -> ReleaseVerdict:
    """The verdict for applying ``plan`` to ``model`` on this release: from the cache, else verified and cached.

    ``why``: why the content is not known verified (shown in the verdict). A verification that could
    not run raises :class:`VerificationNotRun` and leaves the cache as it was.
    """
    from engine.foundation.versions import installed_version

    key, material = key_for(model, plan)
    store = VerdictStore()
    with store.lock(key):  # one verifier per key: other ranks wait here, then read its verdict
        entry = store.read(key, material)
        if entry is not None:
            return ReleaseVerdict.from_entry(entry["verdict"], cache_file=str(store.path(key)), cached=True)
        outcome = verify_on_this_release(model, plan, model_dtype(model), tiny_copy=tiny_copy)
        outside = plan.release
        if not outcome.ran:
            raise _not_run(plan, outcome, why)
        verdict = ReleaseVerdict(
            plan.patchset.name, _spec(plan), outside.installed if outside else (installed_version() or "none"),
            outcome.passed, outcome.finding, outcome.model, material["device"], material["dtype"], plan.mode,
            outcome.checks, outcome.seconds, datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            verify_command(plan.patchset) or "", model_type=plan.model_type, why=why, outside=outside is not None,
        )
        stored = {k: v for k, v in verdict.to_dict().items() if k not in ("cache_file", "cached", "not_cached")}
        path = store.write(key, {"material": material, "passed": verdict.passed, "finding": verdict.finding,
                                 "verdict": stored})
        verdict.cache_file = str(path) if path is not None else None
        if path is None:
            verdict.not_cached = (f"its entries are not trusted: {store.untrusted}" if store.untrusted
                                  else "the cache folder is not writable")
        return verdict


def _how_to_verify(source: str | None) -> str:
    """The command (or call) that shows every check of the verification, as it works when printed."""
    if source:
        return f"patch-engine verify {source}"
    return "engine.verify(tiny_model, patchset) on a tiny model of this type (engine.tiny.build_tiny_model)"


def _not_run(plan: Plan, outcome: Any, why: str) -> VerificationNotRun:
    source = verify_command(plan.patchset)
    text = (
        f"patchset {plan.patchset.name!r} ({why}) had to be verified on this release before patching, and the "
        f"verification could not run, so nothing was patched and no verdict was cached (this is neither a pass nor a "
        f"failure; the next apply tries again): {outcome.cause}\n"
        f"To proceed: verify this model itself instead (engine.apply(model, ..., verify=True): no tiny model), fix "
        f"what the cause names ({_how_to_verify(source)} shows the tiny model's run), or apply it unverified "
        "(unverified='trust'), at your own risk."
    )
    error = VerificationNotRun(text)
    error.cause = outcome.cause
    return error


def _refusal(verdict: ReleaseVerdict) -> SelfVerificationFailed:
    earlier = ", from an earlier apply" if verdict.cached else ""
    if verdict.outside:
        head = (f"patchset {verdict.patchset!r} is verified on transformers{verdict.spec}; installed is "
                f"{verdict.installed}, outside that range, and verifying it on {verdict.installed} failed, so nothing "
                f"was patched ({verdict.summary()}; verdict {verdict.where()}{earlier}):\n")
        fix = (f"The release changed what a target computes, or the declaration never fit: fix the patch the finding "
               f"names ({_how_to_verify(verdict.source)} shows every check; a `when` range keeps the old declaration "
               f"for older releases, docs/versions.md), or install a transformers in {verdict.spec}. ")
        kind: type[SelfVerificationFailed] = ReleaseVerificationFailed
    else:
        head = (f"patchset {verdict.patchset!r}, {verdict.why or 'not bundled content'}, is not content CI verified on "
                f"transformers {verdict.installed}; verifying it there on a {verdict.model} failed, so nothing was "
                f"patched ({verdict.summary()}; verdict {verdict.where()}{earlier}):\n")
        fix = (f"A declaration does not fit what this model computes: fix the patch the finding names "
               f"({_how_to_verify(verdict.source)} shows every check). ")
        kind = SelfVerificationFailed
    text = (head + verdict.finding + "\n" + fix +
            "unverified='trust' would apply it anyway, computing other numbers than the original.")
    error = kind(text)
    error.finding, error.verdict = verdict.finding, verdict
    return error


def _warning_kind(plan: Plan) -> type[UnverifiedContentWarning]:
    return UnverifiedReleaseWarning if plan.release is not None else UnverifiedContentWarning


class ReleaseGate:
    """``before_install`` for :func:`engine.patching.patcher.apply`: the policy's answer to content not known verified.

    After the call, :attr:`path` is the way it went (:class:`VerificationPath`) and :attr:`outcome`
    what the report keeps: the verdict (verified now or cached), the ``OutsideRange`` (trusted, or
    left to the caller's verification of the model itself: ``verified_after``), the path itself
    (unverified content trusted or left to the model's verification), or ``None`` (known verified).
    """

    def __init__(self, model: nn.Module, *, verified_after: bool = False, policy: Policy | None = None,
                 tiny_copy: Callable[[nn.Module], nn.Module] | None = None):
        self.model = model
        self.tiny_copy = tiny_copy  # builds a tiny copy of a model running its own code (remote code)
        self.verified_after = verified_after
        self.policy: Policy = policy or resolve_policy(None)
        self.path: VerificationPath | None = None
        self.outcome: ReleaseVerdict | OutsideRange | VerificationPath | None = None

    def __call__(self, plan: Plan) -> None:
        path = verification_path(self.model, plan, self.policy)
        self.path = path
        if path.kind in ("bundled", "nothing"):
            return
        if self.verified_after and path.kind in ("trust", "verify", "refuse"):
            # apply(verify=...): the model's own verification follows and decides, whatever the policy; saying
            # "patched without verifying it" here would be false a line before that verification runs
            self.outcome = plan.release if plan.release is not None else (path if path.kind == "trust" else None)
            return
        if path.kind == "trust":
            self.outcome = plan.release or path
            command = _how_to_verify(path.source)
            message = (f"patch-engine: {plan.release or path.why}; patched without verifying it there "
                       f"(unverified='trust'). Verify it: engine.verify(model) after apply, or {command}")
            if plan.release is None:
                message = (f"patch-engine: patchset {plan.patchset.name!r}, {path.why}, is not content CI verified on "
                           f"this release; patched without verifying it (unverified='trust'). Verify it: "
                           f"engine.verify(model) after apply, or {command}")
            warnings.warn(message, _warning_kind(plan), stacklevel=4)
            return
        if path.kind == "refuse":
            raise UnverifiedContent(
                f"patchset {plan.patchset.name!r}, {path.why}, is not content known verified on this release (not a "
                f"bundled patchset as CI verified it here, and no passing verdict of its own in the cache), and "
                f"unverified='refuse' applies only what is: nothing was patched. Verify it first: apply it once with "
                f"unverified='verify' (the default: verified on a tiny {path.model_type} model with your model's "
                f"classes, dtype, device, mode and kernels; a pass is cached, and every later apply of it to such a "
                f"model, unverified='refuse' included, reads it). {_how_to_verify(path.source)} shows every check "
                "but records no verdict for your model")
        verdict = release_verdict(self.model, plan, path.why, tiny_copy=self.tiny_copy)
        self.outcome = verdict
        if not verdict.passed:
            raise _refusal(verdict)
        if plan.release is not None:  # a release outside the patchset's range stays a warning, pass or not
            warnings.warn(f"patch-engine: {verdict}; patched", _warning_kind(plan), stacklevel=4)
        elif not verdict.cached:  # content of one's own that passed its self-verification: said, not warned about
            LOG.info("patch-engine: %s; patched", verdict)

    def _deferred(self) -> OutsideRange | None:
        outside = self.outcome
        return outside if isinstance(outside, OutsideRange) and outside.policy == "verify" else None

    def passed_on_model(self, report: Any) -> None:
        """The model's own verification passed: say that it stood for the release's."""
        outside = self._deferred()
        if outside is not None:
            checks = len(report.verification.checks)
            warnings.warn(f"patch-engine: {outside}; this model's own verification (apply(verify=...)) stood for it "
                          f"on {outside.installed}: passed, {checks} checks; patched", UnverifiedReleaseWarning,
                          stacklevel=3)

    def failed_on_model(self, error: Exception) -> None:
        """The model's own verification failed: add the release to what the error says."""
        outside = self._deferred()
        if outside is not None and error.args:
            note = (f"\n(note: {outside}, so the release may have changed what a target computes; a `when` range "
                    "keeps the old declaration for older releases, docs/versions.md)")
            error.args = (f"{error.args[0]}{note}", *error.args[1:])
