"""The release gate: what :func:`engine.apply` does between planning and patching when the release is unverified.

The plan says whether the installed transformers is outside the patchset's ``requires``
(``Plan.release``, set by the planner under the ``verify`` and ``trust`` policies; ``refuse``
has already raised there). The gate then, before anything changes:

* ``trust``: warns (:class:`UnverifiedReleaseWarning`) and lets the patch go on;
* ``verify``: looks the verdict up in the cache (:mod:`engine.releases.cache`, keyed by
  :mod:`engine.releases.key`), else verifies the patchset on this release
  (:mod:`engine.releases.self_verify`) and caches the verdict. Passed: one warning naming the
  release and the cache file, and the patch goes on. Failed: :class:`ReleaseVerificationFailed`
  with the verifier's finding; the model is untouched.
"""

from __future__ import annotations

import datetime
import warnings
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from engine.errors import ReleaseVerificationFailed, UnverifiedReleaseWarning
from engine.foundation.release_policy import OutsideRange
from engine.kernels.triton_interpret import is_interpreting
from engine.planning.decisions import Plan
from engine.releases.cache import VerdictStore
from engine.releases.key import device_kind, key_material, key_of
from engine.releases.self_verify import kernels_of, verify_on_this_release
from engine.verification.compare import DTYPE_NAMES

__all__ = ["ReleaseGate", "ReleaseVerdict", "release_verdict"]


@dataclass
class ReleaseVerdict:
    """The self-verification of one patchset on one unverified release (fresh, or read from the cache)."""

    patchset: str
    spec: str  # the patchset's requires.transformers
    installed: str  # the transformers release it was verified on
    passed: bool
    finding: str  # the verifier's failure message ("" when it passed)
    model: str  # what it ran on: "tiny qwen3 (Qwen3ForCausalLM)"
    device: str  # device kind (engine.releases.key.device_kind)
    dtype: str
    mode: str
    checks: int
    seconds: float  # how long the verification took (when it ran)
    verified_at: str  # UTC, ISO 8601
    source: str = ""  # the patchset's file (or its name, for a dict), for the commands the messages suggest
    cache_file: str | None = None  # where the verdict is kept (None: it could not be written)
    cached: bool = False  # read from the cache by this apply (no verification ran)

    def where(self) -> str:
        return f"cached in {self.cache_file}" if self.cache_file else "not cached (the cache folder is not writable)"

    def summary(self) -> str:
        """``tiny qwen3 (Qwen3ForCausalLM), cpu, fp32, training: 27 checks in 6.1 s``."""
        return f"{self.model}, {self.device}, {self.dtype}, {self.mode}: {self.checks} checks in {self.seconds} s"

    def __str__(self) -> str:
        result = "passed" if self.passed else "FAILED"
        how = (f"verified there at {self.verified_at}: {result} ({self.summary()}); verdict read from {self.cache_file}"
               if self.cached else f"verified there first: {result} ({self.summary()}); verdict {self.where()}")
        return (f"patchset {self.patchset!r} is verified on transformers{self.spec}; installed {self.installed} is "
                f"outside that range, so it was {how}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _model_dtype(model: nn.Module) -> torch.dtype:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def _device_index(model: nn.Module, device: str) -> int | None:
    return next((p.device.index for p in model.parameters() if p.device.type == device), None)


def release_verdict(model: nn.Module, plan: Plan) -> ReleaseVerdict:
    """The verdict for applying ``plan`` to ``model`` on this release: from the cache, else verified and cached."""
    outside = plan.release
    assert outside is not None, "release_verdict is for a plan outside its patchset's range"
    dtype = _model_dtype(model)
    interpreted = plan.device.value == "cuda" and is_interpreting()
    kind = device_kind(plan.device.value, interpreted=interpreted, index=_device_index(model, plan.device.value))
    material = key_material(plan.patchset, device_kind=kind, dtype=DTYPE_NAMES.get(dtype, str(dtype)),
                            mode=plan.mode, kernels=kernels_of(plan))
    key = key_of(material)
    store = VerdictStore()
    with store.lock(key):  # one verifier per key: other ranks wait here, then read its verdict
        entry = store.read(key, material)
        if entry is not None:
            return ReleaseVerdict(**entry["verdict"], cache_file=str(store.path(key)), cached=True)
        outcome = verify_on_this_release(model, plan, dtype)
        verdict = ReleaseVerdict(
            outside.patchset, outside.spec, outside.installed, outcome.passed, outcome.finding, outcome.model, kind,
            material["dtype"], plan.mode, outcome.checks, outcome.seconds,
            datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            plan.file or plan.patchset.name,
        )
        stored = {k: v for k, v in verdict.to_dict().items() if k not in ("cache_file", "cached")}
        path = store.write(key, {"material": material, "passed": verdict.passed, "finding": verdict.finding,
                                 "verdict": stored})
        verdict.cache_file = str(path) if path is not None else None
        return verdict


def _refusal(verdict: ReleaseVerdict) -> ReleaseVerificationFailed:
    text = (
        f"patchset {verdict.patchset!r} is verified on transformers{verdict.spec}; installed is {verdict.installed}, "
        f"outside that range, and verifying it on {verdict.installed} failed, so nothing was patched "
        f"({verdict.summary()}; verdict {verdict.where()}{', from an earlier apply' if verdict.cached else ''}):\n"
        f"{verdict.finding}\n"
        f"The release changed what a target computes, or the declaration never fit: fix the patch the finding names "
        f"(patch-engine verify {verdict.source or verdict.patchset} shows every check; a `when` range keeps the old "
        f"declaration for older releases, docs/versions.md), or install a transformers in {verdict.spec}. "
        "unverified_release='trust' would apply it anyway, computing other numbers than the original."
    )
    error = ReleaseVerificationFailed(text)
    error.finding, error.verdict = verdict.finding, verdict
    return error


class ReleaseGate:
    """``before_install`` for :func:`engine.patching.patcher.apply`: the policy's answer to ``Plan.release``.

    After the call, :attr:`outcome` is the verdict (``verify``), the ``OutsideRange`` (``trust``,
    or ``verify`` left to the caller's verification of the model itself: ``verified_after``) or
    ``None`` (inside the range), for the report.
    """

    def __init__(self, model: nn.Module, *, verified_after: bool = False):
        self.model = model
        self.verified_after = verified_after
        self.outcome: ReleaseVerdict | OutsideRange | None = None

    def __call__(self, plan: Plan) -> None:
        outside = plan.release
        if outside is None:
            return
        if outside.policy == "trust":
            self.outcome = outside
            message = (f"patch-engine: {outside}; patched without verifying it there (unverified_release='trust'). "
                       f"Verify it: engine.verify(model) after apply, or patch-engine verify {outside.patchset}")
            warnings.warn(message, UnverifiedReleaseWarning, stacklevel=4)
            return
        if self.verified_after:  # apply(verify=...): the model's own verification follows, and decides
            self.outcome = outside
            return
        verdict = release_verdict(self.model, plan)
        self.outcome = verdict
        if not verdict.passed:
            raise _refusal(verdict)
        warnings.warn(f"patch-engine: {verdict}; patched", UnverifiedReleaseWarning, stacklevel=4)

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
