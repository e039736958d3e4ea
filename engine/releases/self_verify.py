"""Verify a plan's patchset on the installed transformers: a tiny model of the user's type, the plan's device, dtype, mode and kernels.

This is ``patch-engine verify FILE`` made to stand for one ``apply``: the same judge
(:func:`engine.verification.verify`: every patched module's declaration and kernel in fp32 and
the low-precision dtype, then the whole model's logits, loss and every gradient against the
original and its fp64 truth), on a tiny model built by *this* release's own config and
modeling classes, so a release that changed what a target computes (mamba2's per-group gated
norm in 5.23) or a declaration that never fit (``scale: one_plus_weight`` on Qwen3's norms)
fails here, before the user's model is touched. The tiny model is built in the user's model
dtype, placed on the plan's device, put in the plan's mode, and patched with the kernel each
patch got in the user's plan (pinned by name), so the kernels verified are the kernels about to
be installed.

Two rules make a pass mean something for *this* model:

* the tiny model is of the **user's model type** (``plan.model_type``), not of the patchset's
  ``tiny_model.model_type``: a patchset for ``[qwen3, llama]`` whose tiny model is a llama would
  otherwise be verified where its Qwen3 patches never install. The patchset's own ``tiny_model``
  config is used where it is for that type; another type gets the scaffold's tiny config of its
  config class (:func:`engine.tiny.config.derive_tiny_config`);
* every patch the plan installs on the user's model must have been **installed and run** in the
  tiny model (the verifier fails a patched module that is never called); one that was not is a
  failed verification naming it, not a pass that vouched for nothing.

A verification that could not run (an exception while building, planning or patching the tiny
model, or not one check) is not a verdict: :attr:`Outcome.ran` is false and the gate neither
caches it nor takes it as a pass.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.errors import InvalidArgument, VersionMismatch
from engine.kernels import compiled
from engine.kernels.triton_interpret import is_interpreting
from engine.patching.patcher import apply, revert
from engine.planning.decisions import Plan
from engine.runtime.control_flow import not_a_failure
from engine.schema import Device, Patchset, TinyModel
from engine.tiny import build_tiny_for
from engine.tiny.adopt import adopt_classes
from engine.tiny.construction import callers_random_state, own_construction
from engine.verification import verify
from engine.verification.results import failure_message

__all__ = ["Outcome", "declared_tiny_type", "kernels_of", "own_code", "patch_where", "pinned", "tiny_for_type",
           "verify_on_this_release"]


@dataclass(frozen=True)
class Outcome:
    """What the self-verification found: passed or not, the verifier's finding, on what, in how long.

    ``ran`` false: it could not run (``cause`` says why); that is no verdict, pass or fail.
    """

    passed: bool
    finding: str  # the verifier's failure message ("" when it passed)
    model: str  # "tiny qwen3 (Qwen3ForCausalLM)"
    checks: int
    seconds: float
    ran: bool = True
    cause: str = ""  # why it could not run ("" when it ran)


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


def declared_tiny_type(patchset: Patchset) -> str:
    """The model type of the patchset's own tiny model: ``tiny_model.model_type``, else its first model type."""
    tiny = patchset.tiny_model
    return (tiny.model_type if tiny and tiny.model_type else None) or patchset.model_types[0]


def tiny_for_type(patchset: Patchset, model_type: str, *, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A tiny, perturbed model of ``model_type`` to verify ``patchset`` on.

    The patchset's ``tiny_model`` where it is for ``model_type``; else the scaffold's tiny config of
    that type's config class (the patchset's config is for another class and may not even build).
    Raises what :func:`engine.tiny.build_tiny_for` raises (a :class:`PatchsetError` naming the key,
    :class:`VersionMismatch` where this release cannot build it).
    """
    if model_type == declared_tiny_type(patchset):
        return build_tiny_for(patchset, model_type, dtype=dtype)
    from engine.tiny.config import derive_tiny_config

    twin = patchset.model_copy(update={"tiny_model": TinyModel(model_type=model_type,
                                                               config=derive_tiny_config(model_type))})
    twin._files, twin._origins = patchset._files, patchset._origins
    return build_tiny_for(twin, model_type, dtype=dtype)


def patch_where(patchset: Patchset, index: int) -> str:
    """``patches[0] (Qwen3RMSNorm) at /abs/my_qwen3.yaml:9``: a patch by its index, target and line."""
    from engine.loader import patch_location

    patch = patchset.patches[index]
    target = getattr(patch, "target", None) or getattr(patch, "function", None) or patch.op
    at = patch_location(patchset, index).rstrip(": ")
    return f"patches[{index}] ({target})" + (f" at {at}" if at else "")


def _tiny_device(model: nn.Module, plan: Plan) -> torch.device:
    """Where the tiny model runs: the user's model's device of the plan's type, else that type's default."""
    if plan.device is Device.cuda and is_interpreting():
        return torch.device("cpu")  # the CUDA plan's Triton kernels run on CPU tensors, interpreted
    for p in model.parameters():
        if p.device.type == plan.device.value:
            return p.device
    # none there (a model whose tensors stay on the CPU for a device whose kernels take them: an emulator) or
    # offloaded to meta: where its real parameters are, else the plan's device
    real = next((p.device for p in model.parameters() if p.device.type != "meta"), None)
    return real if real is not None else torch.device(plan.device.value)


def _not_installed(plan: Plan, installed: set[int], tiny_plan: Any, label: str) -> str:
    """The finding for patches the user's plan installs that the tiny model did not install ("" if none)."""
    missing = sorted({d.patch_index for d in plan.patched} - installed)
    if not missing:
        return ""
    lines = []
    for index in missing:
        modules = sum(d.patch_index == index for d in plan.patched)
        why = next((d.reason for d in tiny_plan.decisions if d.patch_index == index), "no module of it")
        lines.append(f"  {patch_where(plan.patchset, index)}: installed on {modules} module(s) of this "
                     f"{plan.model_type} model, not in the {label} ({why})")
    return ("patches the plan installs on this model did not run in the tiny model it was verified on, so nothing "
            "verified them:\n" + "\n".join(lines) + "\nGive the patchset a tiny_model of this type whose config has "
            "those modules (tiny_model.config), or verify this model itself: engine.apply(model, ..., verify=True)")


def _located_failures(report: Any, decisions: Any, patchset: Patchset) -> str:
    """Where each failing module's patch is declared: one line per patch (``""`` when none is a module's)."""
    index_of = {d.path: d.patch_index for d in decisions}
    failing = sorted({index_of[c.path] for c in report.failures if c.path in index_of})
    if not failing:
        return ""
    return "\ndeclared at:\n" + "\n".join(f"  {patch_where(patchset, i)}" for i in failing)


#: The package transformers imports ``trust_remote_code`` modeling files under.
REMOTE_CODE = "transformers_modules."


def own_code(model: nn.Module, model_type: str) -> bool:
    """Whether ``model`` runs code transformers cannot build by its type: a checkpoint's own (remote code), or a type
    no config of transformers' names. A tiny model of its *type* would then run other code than the user's."""
    from transformers import CONFIG_MAPPING

    return type(model).__module__.startswith(REMOTE_CODE) or model_type not in CONFIG_MAPPING


def _tiny(model: nn.Module, patchset: Patchset, plan: Plan, dtype: torch.dtype,
          tiny_copy: Callable[[nn.Module], nn.Module] | None) -> nn.Module:
    """The tiny model to verify on: of the user's type, or a tiny copy of the user's own classes (own code).

    Either way each of its modules then has the class the user's model has at that place
    (:func:`engine.tiny.adopt.adopt_classes`): a same-named class of the user's, a subclass with
    its own forward, is what gets verified, never transformers' class standing in for it.
    """
    if not own_code(model, plan.model_type):
        tiny = tiny_for_type(patchset, plan.model_type, dtype=dtype)
    elif tiny_copy is None:
        raise InvalidArgument(f"{type(model).__name__} runs its own code ({type(model).__module__}), so no tiny "
                              f"{plan.model_type} model of transformers' can stand for it")
    else:
        tiny = tiny_copy(model).to(dtype)
    adopt_classes(tiny, model, required=[d.path for d in plan.patched if d.site is None])
    return tiny


def verify_on_this_release(model: nn.Module, plan: Plan, dtype: torch.dtype, *,
                           tiny_copy: Callable[[nn.Module], nn.Module] | None = None) -> Outcome:
    """Build a tiny model of the user's type (``plan.model_type``), patch it as ``plan`` says, verify it.

    A model running its own code (remote code, a type transformers does not define) is verified on
    ``tiny_copy(model)``: a tiny copy built from its own config and model classes (the facade passes
    :func:`engine.zeroconfig.tiny_copy.tiny_copy`); without one, the verification cannot run.

    A tiny model that cannot be built, planned, patched or run, or a verification without one
    check, is an outcome with ``ran=False`` and the cause (the gate refuses this apply with it and
    caches nothing). A tiny model that this release cannot build where the patchset is outside its
    range raises :class:`VersionMismatch` (from :func:`engine.tiny.build_tiny_for`).
    """
    start = time.perf_counter()
    patchset = pinned(plan)
    label = f"tiny {plan.model_type} model"
    try:
        # the tiny model's own warnings are not the user's (their model's come later); its tensors are made on its
        # own device, not in the context the user's model is built in (a meta device: tiny/construction.py), and the
        # user's random state is left as it was
        device = _tiny_device(model, plan)
        with warnings.catch_warnings(), own_construction(device), callers_random_state(device):
            warnings.simplefilter("ignore")
            tiny = _tiny(model, patchset, plan, dtype, tiny_copy).to(device)
            label = f"tiny {tiny.config.model_type} ({type(tiny).__name__})"
            tiny.train(plan.mode == "training")
            # compiled code only where this model would run it (an fp32 training model: nowhere)
            with compiled.only_where(dtype, plan.mode == "training"):
                tiny_report = apply(tiny, patchset, device=plan.device, mode=plan.mode, unverified_release="trust")
                try:
                    report = verify(tiny, raise_on_failure=False, conditions="budget")
                finally:
                    revert(tiny)
    except (VersionMismatch, *not_a_failure()):  # unbuildable here: that refusal says it all; out of memory
        raise
    except Exception as exc:  # noqa: BLE001  (whatever stops the tiny model stops the verification: no verdict)
        cause = (f"the {label} of patchset {plan.patchset.name!r} could not be built, planned, patched or run on "
                 f"this release: {type(exc).__name__}: {str(exc)[:2000]}")
        return Outcome(False, "", label, 0, round(time.perf_counter() - start, 2), ran=False, cause=cause)
    seconds = round(time.perf_counter() - start, 2)
    if not report.checks:
        return Outcome(False, "", label, 0, seconds, ran=False,
                       cause=f"the verification of the {label} ran no check (nothing of the patchset was patched there)")
    installed = {d.patch_index for d in tiny_report.decisions if d.action == "patch"}
    missing = _not_installed(plan, installed, tiny_report, label)
    finding = "" if report.passed else failure_message(report) + _located_failures(report, tiny_report.decisions,
                                                                                   plan.patchset)
    finding = "\n".join(part for part in (finding, missing) if part)
    return Outcome(report.passed and not missing, finding, label, len(report.checks), seconds)
