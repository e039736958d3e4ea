"""Measured declarations verified on the tiny copy they were measured on, one verdict per content, cached.

The judge is the one every patchset meets (:func:`engine.verification.verify`: each patched
module's declaration and kernel in fp32 and the low-precision dtype, then the whole model's
logits, loss and gradients against the original), run on :func:`engine.zeroconfig.tiny_copy.tiny_copy`
of the user's model, in its dtype, on its device, in the plan's mode, with the kernels the
plan chose for the user's model (pinned by name), as the release gate verifies a user's file
(:mod:`engine.releases.self_verify`). Its verdict lives in the same cache
(:class:`engine.releases.VerdictStore`), keyed by the measured content, the release and the
settings (:func:`engine.releases.key.key_material`) plus the model's code.

A declaration that fails is dropped, never applied: the module checks say which patch failed;
where only the whole model fails, each patch is verified alone and those failing alone are
dropped; the rest is verified again, so what is applied is what passed.
"""

from __future__ import annotations

import datetime
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from engine.kernels import compiled
from engine.kernels.triton_interpret import is_interpreting
from engine.patching.patcher import apply, revert
from engine.planning.decisions import Plan
from engine.releases import VerdictStore
from engine.releases.key import device_kind, key_material, key_of
from engine.releases.self_verify import kernels_of, pinned
from engine.runtime.control_flow import not_a_failure
from engine.schema import Patchset
from engine.tiny.construction import callers_random_state, own_construction
from engine.verification import verify
from engine.verification.compare import DTYPE_NAMES, floating_dtype
from engine.verification.results import failure_message
from engine.zeroconfig.tiny_copy import code_identity, tiny_copy

__all__ = ["MeasuredVerdict", "subset", "verified_subset"]

#: At most this many verify-and-drop rounds (each drops at least one patch).
MAX_ROUNDS = 4


@dataclass
class MeasuredVerdict:
    """The verification of one measured patchset on the tiny copy: which patches passed, which failed and why."""

    passed: list[int]  # indices into the measured patchset's patches, verified together
    failed: dict[int, str] = field(default_factory=dict)  # index -> the verifier's finding
    checks: int = 0
    seconds: float = 0.0
    model: str = ""  # "tiny copy of Qwen3ForCausalLM"
    device: str = "cpu"
    dtype: str = "fp32"
    mode: str = "training"
    verified_at: str = ""
    cached: bool = False
    cache_file: str | None = None
    problem: str = ""  # a verification that could not run at all (nothing passes then)


def subset(patchset: Patchset, indices: list[int]) -> Patchset:
    """``patchset`` with only the patches at ``indices`` (in order)."""
    return patchset.model_copy(update={"patches": [patchset.patches[i] for i in indices]})


def _model_device(model: nn.Module, plan: Plan) -> torch.device:
    for p in model.parameters():
        if p.device.type == plan.device.value:
            return p.device
    return torch.device(plan.device.value)


def _failed_indices(report: Any, decisions: Any, indices: list[int]) -> dict[int, str]:
    """Patch index (into the measured patchset) -> finding, for every patch a failed module check names."""
    by_class: dict[tuple[str, str], set[int]] = {}
    for d in decisions:
        key = (d.cls, d.op) if d.cls != "function" else ("function", d.path.rsplit(".", 1)[-1])
        by_class.setdefault(key, set()).add(indices[d.patch_index])
    failed: dict[int, list[Any]] = {}
    for check in report.checks:
        if check.passed or check.path == "<model>":
            continue
        key = (check.cls, check.op) if check.cls != "function" else ("function", check.path.rsplit(".", 1)[-1])
        for index in by_class.get(key, ()):
            failed.setdefault(index, []).append(check)
    return {i: failure_message(type(report)(checks=checks)) for i, checks in failed.items()}


def _verify_once(tiny: nn.Module, patchset: Patchset, plan: Plan, fused: Any) -> tuple[Any, Any]:
    applied = apply(tiny, patchset, device=plan.device, mode=plan.mode, fused_cross_entropy=fused,
                    unverified_release="trust")
    try:
        return verify(tiny, raise_on_failure=False, conditions="budget"), applied.decisions
    finally:
        revert(tiny)


def _run(model: nn.Module, plan: Plan, fused: Any) -> MeasuredVerdict:
    start = time.perf_counter()
    dtype = floating_dtype(model.parameters())
    device = _model_device(model, plan)
    verdict = MeasuredVerdict(passed=[], model=f"tiny copy of {type(model).__name__}", mode=plan.mode,
                              dtype=DTYPE_NAMES.get(dtype, str(dtype)))
    patchset = pinned(plan)
    remaining = sorted({d.patch_index for d in plan.patched})
    try:
        with warnings.catch_warnings(), own_construction(device), callers_random_state(device):
            warnings.simplefilter("ignore")
            tiny = tiny_copy(model).to(device=device, dtype=dtype)
            tiny.train(plan.mode == "training")
            with compiled.only_where(dtype, plan.mode == "training"):
                for _ in range(MAX_ROUNDS):
                    if not remaining:
                        break
                    report, decisions = _verify_once(tiny, subset(patchset, remaining), plan, fused)
                    verdict.checks += len(report.checks)
                    installed = {remaining[d.patch_index] for d in decisions if d.action == "patch"}
                    unverified = {i: "it patches modules of this model but none of its tiny copy, so nothing verified "
                                     "it" for i in remaining if i not in installed}
                    if report.passed and not unverified:
                        break
                    if report.passed:  # verified what ran; what did not run in the tiny copy is not applied
                        verdict.failed.update(unverified)
                        remaining = [i for i in remaining if i not in unverified]
                        break
                    bad = _failed_indices(report, decisions, remaining)
                    if not bad:  # only the whole model differs: each patch alone says which
                        whole = failure_message(report)
                        for index in remaining:
                            alone, _ = _verify_once(tiny, subset(patchset, [index]), plan, fused)
                            verdict.checks += len(alone.checks)
                            if not alone.passed:
                                bad[index] = failure_message(alone)
                        bad = bad or dict.fromkeys(remaining, whole)
                    verdict.failed.update(bad)
                    remaining = [i for i in remaining if i not in bad]
                else:
                    verdict.failed.update(dict.fromkeys(remaining, "still failing after the failing patches were dropped"))
                    remaining = []
    except not_a_failure():
        raise
    except Exception as exc:  # noqa: BLE001  (a verification that could not run: nothing passes, and it says why)
        verdict.problem = f"the verification on a tiny copy could not run: {type(exc).__name__}: {str(exc)[:500]}"
        remaining = []
    verdict.passed = remaining
    verdict.seconds = round(time.perf_counter() - start, 2)
    verdict.verified_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    return verdict


#: This process's verdicts by key (what a second apply in the same process reads instead of the file).
_MEMO: dict[tuple[str, str], MeasuredVerdict] = {}


def _copy(verdict: MeasuredVerdict, **changes: Any) -> MeasuredVerdict:
    return replace(verdict, failed=dict(verdict.failed), passed=list(verdict.passed), **changes)


def verified_subset(model: nn.Module, measured: Patchset, plan: Plan, *, fused_cross_entropy: Any = None,
                    identity: dict[str, Any] | None = None) -> MeasuredVerdict:
    """The verdict on ``measured`` (``plan.patchset``) as ``plan`` (for ``model``) would install it: from the cache, else verified and cached.

    A verification that could not run (an exception, a tiny copy that does not build) is
    reported, never cached: it is no verdict.
    """
    dtype = floating_dtype(model.parameters())
    interpreted = plan.device.value == "cuda" and is_interpreting()
    kind = device_kind(plan.device.value, interpreted=interpreted)
    material = key_material(pinned(plan), device_kind=kind, dtype=DTYPE_NAMES.get(dtype, str(dtype)),
                            mode=plan.mode, kernels=kernels_of(plan))
    material["measured_on"] = identity or code_identity(model)
    key = key_of(material)
    store = VerdictStore()
    memo = (str(store.folder), key)  # per cache folder: a hit names a file that is there
    if memo in _MEMO:
        return _copy(_MEMO[memo], cached=True, cache_file=str(store.path(key)))
    fields = ("passed", "checks", "seconds", "model", "device", "dtype", "mode", "verified_at")
    with store.lock(key):
        entry = store.read(key, material)
        if entry is not None and isinstance(entry.get("measured"), dict):
            data = entry["measured"]
            try:
                done = MeasuredVerdict(**{k: data[k] for k in fields},
                                       failed={int(k): str(v) for k, v in data["failed"].items()})
            except (KeyError, TypeError, ValueError):
                done = None
            if done is not None:
                done.cached, done.cache_file = True, str(store.path(key))
                _MEMO[memo] = done
                return _copy(done)
        verdict = _run(model, plan, fused_cross_entropy)
        verdict.device = kind
        if verdict.problem:
            return verdict
        _MEMO[memo] = _copy(verdict)
        data = {k: getattr(verdict, k) for k in fields}
        data["failed"] = {str(k): v for k, v in verdict.failed.items()}
        path = store.write(key, {"material": material, "passed": not verdict.failed,
                                 "finding": "\n".join(verdict.failed.values()), "measured": data})
        verdict.cache_file = str(path) if path is not None else None
        return verdict
