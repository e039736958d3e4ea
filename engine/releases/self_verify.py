"""Verify a plan's patchset on the installed transformers: the tiny model of its type, the plan's device, dtype, mode and kernels.

This is ``patch-engine verify NAME`` made to stand for one ``apply``: the same judge
(:func:`engine.verification.verify`: every patched module's declaration and kernel in fp32 and
the low-precision dtype, then the whole model's logits, loss and every gradient against the
original and its fp64 truth), on a tiny model built by *this* release's own config and
modeling classes, so a release that changed what a target computes (mamba2's per-group gated
norm in 5.23) fails here, before the user's model is touched. The tiny model is built in the
user's model dtype, placed on the plan's device, put in the plan's mode, and patched with the
kernel each patch got in the user's plan (pinned by name), so the kernels verified are the
kernels about to be installed.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from engine.errors import VersionMismatch
from engine.kernels import compiled
from engine.kernels.triton_interpret import is_interpreting
from engine.patching.patcher import apply, revert
from engine.planning.decisions import Plan
from engine.runtime.control_flow import not_a_failure
from engine.schema import Device, Patchset
from engine.tiny import build_tiny_for
from engine.tiny.construction import callers_random_state, own_construction
from engine.verification import verify
from engine.verification.results import failure_message

__all__ = ["Outcome", "kernels_of", "pinned", "verify_on_this_release"]


@dataclass(frozen=True)
class Outcome:
    """What the self-verification found: passed or not, the verifier's finding, on what, in how long."""

    passed: bool
    finding: str  # the verifier's failure message ("" when it passed)
    model: str  # "tiny qwen3 (Qwen3ForCausalLM)"
    checks: int
    seconds: float


def kernels_of(plan: Plan) -> dict[str, list[str]]:
    """Patch index -> the kernels the plan installs for it (one, unless modules of one patch differ)."""
    found: dict[str, set[str]] = {}
    for d in plan.patched:
        found.setdefault(str(d.patch_index), set()).add(d.kernel or "-")
    return {k: sorted(v) for k, v in found.items()}


def pinned(plan: Plan) -> Patchset:
    """The plan's patchset with each patch's kernel named as the plan chose it (where it chose one).

    Why: ``auto`` on the tiny model could pick another kernel than it did on the user's model
    (DTensor parameters, a dtype rule); pinned, the verification runs the kernels about to be installed.
    """
    chosen = kernels_of(plan)
    patches = []
    for index, patch in enumerate(plan.patchset.patches):
        kernels = chosen.get(str(index), [])
        if len(kernels) == 1 and kernels[0] != "-" and getattr(patch, "kernel", None) is not None:
            patch = patch.model_copy(update={"kernel": kernels[0]})
        patches.append(patch)
    twin = plan.patchset.model_copy(update={"patches": patches})
    twin._files, twin._origins = plan.patchset._files, plan.patchset._origins
    return twin


def _tiny_device(model: nn.Module, plan: Plan) -> torch.device:
    """Where the tiny model runs: the user's model's device of the plan's type, else that type's default."""
    if plan.device is Device.cuda and is_interpreting():
        return torch.device("cpu")  # the CUDA plan's Triton kernels run on CPU tensors, interpreted
    for p in model.parameters():
        if p.device.type == plan.device.value:
            return p.device
    return torch.device(plan.device.value)


def verify_on_this_release(model: nn.Module, plan: Plan, dtype: torch.dtype) -> Outcome:
    """Build the tiny model of ``plan.patchset``'s type, patch it as ``plan`` says, verify it.

    A tiny model that cannot be planned, patched or run is a failed outcome with that reason
    (the caller refuses with it): nothing can vouch for the release then. One that this release
    cannot build raises :class:`VersionMismatch` (from :func:`engine.tiny.build_tiny_for`).
    """
    start = time.perf_counter()
    patchset = pinned(plan)
    label = "tiny model"
    try:
        # the tiny model's own warnings are not the user's (their model's come later); its tensors are made on its
        # own device, not in the context the user's model is built in (a meta device: tiny/construction.py), and the
        # user's random state is left as it was
        device = _tiny_device(model, plan)
        with warnings.catch_warnings(), own_construction(device), callers_random_state(device):
            warnings.simplefilter("ignore")
            tiny = build_tiny_for(patchset, dtype=dtype).to(device)
            label = f"tiny {tiny.config.model_type} ({type(tiny).__name__})"
            tiny.train(plan.mode == "training")
            # compiled code only where this model would run it (an fp32 training model: nowhere)
            with compiled.only_where(dtype, plan.mode == "training"):
                apply(tiny, patchset, device=plan.device, mode=plan.mode, unverified_release="trust")
                try:
                    report = verify(tiny, raise_on_failure=False)
                finally:
                    revert(tiny)
    except (VersionMismatch, *not_a_failure()):  # unbuildable here: that refusal says it all; out of memory
        raise
    except Exception as exc:  # noqa: BLE001  (whatever stops the tiny model is the finding: nothing vouches for the release)
        finding = (f"the {label} of patchset {plan.patchset.name!r} could not be built, planned or verified on this "
                   f"release: {type(exc).__name__}: {exc}")
        return Outcome(False, finding, label, 0, round(time.perf_counter() - start, 2))
    finding = "" if report.passed else failure_message(report)
    return Outcome(report.passed, finding, label, len(report.checks), round(time.perf_counter() - start, 2))
