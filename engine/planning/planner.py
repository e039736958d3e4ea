"""Planning: decide, for one model and one device, what each patch will do. Changes nothing.

Every check that can fail runs here, so that :func:`engine.apply` can refuse before it
touches the model: the model type, the library version, that every required target
matches at least one module (or function call site), that the target's forward is the
one the op expects, and that the chosen kernel runs on the device and imports.
"""

from __future__ import annotations

import difflib
import inspect
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from engine.errors import (
    DeviceUnsupported,
    InvalidArgument,
    KernelNotFound,
    MissingDependency,
    ModelTypeMismatch,
    PatchError,
    PatchsetError,
    SignatureMismatch,
    TargetNotFound,
    shortened,
)
from engine.foundation.see_through import see_through
from engine.ops.base import FunctionOp, ModuleOp, get_op
from engine.planning.call_sites import calls_name as _calls_name
from engine.planning.call_sites import never_calls
from engine.planning.decisions import Decision, FunctionSite, Mode, Plan
from engine.planning.kernel_choice import resolve_kernel
from engine.runtime.devices import resolve_device
from engine.runtime.placements import dtensor_parameter
from engine.runtime.release import check_release
from engine.schema import Device, FunctionPatch, ModulePatch, Patchset

__all__ = ["Decision", "FunctionSite", "Mode", "Plan", "plan", "resolve_kernel"]

def plan(
    model: nn.Module,
    patchset: Patchset | str | dict[str, Any],
    *,
    device: str | Device | torch.device | None = None,
    mode: Mode | None = None,
    fused_cross_entropy: Any = None,
    unverified_release: str | None = None,
) -> Plan:
    """Decide what applying ``patchset`` to ``model`` would do; the model is not changed.

    Args:
        model: a transformers model (anything with ``config.model_type`` and submodules), or
            a peft ``PeftModel`` around one (planned as the model inside).
        patchset: a Patchset, a bundled name (``"qwen3"``), a path, or a dict.
        device: the device type to plan for; default: where the model's parameters are
            (the current accelerator if they are on several devices or all offloaded). A plan
            for a device this machine lacks is a dry run; :func:`engine.apply` refuses it.
        mode: ``"training"`` (kernels need a backward) or ``"inference"``; default:
            ``"training"`` if ``model.training`` else ``"inference"``.
        fused_cross_entropy: fuse the causal-LM head + loss (``True``, ``False``, or
            ``{kernel, chunk_size}``); ``None`` keeps the patchset's ``fused_cross_entropy``
            key. See :mod:`engine.planning.fused_head`.
        unverified_release: what a transformers release outside the patchset's ``requires``
            gets: ``"verify"`` (default; the plan records it in ``Plan.release`` and
            :func:`engine.apply` verifies the patchset on that release before patching),
            ``"refuse"`` (:class:`VersionMismatch`) or ``"trust"``; unset, the environment
            variable ``PATCH_ENGINE_UNVERIFIED_RELEASE`` decides
            (:mod:`engine.foundation.release_policy`).

    Raises:
        PatchsetError, ModelTypeMismatch, VersionMismatch, TargetNotFound,
        SignatureMismatch, DeviceUnsupported, MissingDependency, KernelNotFound.
    """
    from engine.loader import load_patchset
    from engine.planning.fused_head import with_fused_cross_entropy
    from engine.runtime.wrappers import unwrap

    model = unwrap(model)  # a PeftModel is planned as the transformers model inside it
    if not isinstance(patchset, Patchset):
        patchset = load_patchset(patchset)
    # first: a release outside `requires` refused by the policy is the answer, whatever else is wrong
    release = check_release(patchset, policy=unverified_release)
    patchset = with_fused_cross_entropy(patchset, model, fused_cross_entropy)
    dev = resolve_device(model, device)
    run_mode: Mode = check_mode(mode) or ("training" if model.training else "inference")
    model_type = _check_model_type(model, patchset)
    from engine.foundation.versions import patch_is_active

    decisions: list[Decision] = []
    active = [i for i, p in enumerate(patchset.patches) if patch_is_active(p)]
    _check_one_per_target(patchset, active)
    for index, patch in enumerate(patchset.patches):
        if index not in active:
            decisions.append(_inactive(index, patch))
            continue
        op = get_op(patch.op)
        try:
            if isinstance(op, ModuleOp):
                decisions.extend(_plan_module_patch(model, patchset, index, patch, op, dev, run_mode))
            elif isinstance(op, FunctionOp):
                decisions.extend(_plan_function_patch(model, patchset, index, patch, op, dev, run_mode))
            else:  # pragma: no cover - every op is one of the two kinds
                raise TypeError(f"op {patch.op!r} is neither a module nor a function op")
        except PatchError as exc:
            raise _located(exc, patchset, index) from None
    decisions = _with_sub_models(model, decisions)
    return Plan(patchset=patchset, device=dev, mode=run_mode, model_type=model_type, decisions=tuple(decisions),
                release=release)


MODES: tuple[str, ...] = ("training", "inference")
_MODE_HINTS = {"train": "training", "eval": "inference", "evaluation": "inference", "infer": "inference"}


def check_mode(mode: Any) -> Mode | None:
    """``mode`` itself if it is one of :data:`MODES` (or None); else :class:`InvalidArgument` naming the fix.

    Why: a typo (``mode="train"``) compared unequal to ``"training"`` and was silently planned
    as inference, with kernels that have no backward.
    """
    if mode is None or mode in MODES:
        return mode
    guess = _MODE_HINTS.get(str(mode).lower()) or next(iter(difflib.get_close_matches(str(mode), MODES, n=1)), None)
    hint = f"; did you mean mode={guess!r}?" if guess else ""
    raise InvalidArgument(
        f"mode={mode!r} is not a mode; use mode='training' (kernels need a backward) or mode='inference', "
        f"or leave it unset to follow model.training{hint}"
    )


def _with_sub_models(model: nn.Module, decisions: list[Decision]) -> list[Decision]:
    """Each decision with the sub-model (language model, vision tower) it belongs to."""
    from dataclasses import replace

    from engine.runtime.submodels import sub_model_of, sub_model_paths

    roots = sub_model_paths(model)
    out = []
    for d in decisions:
        paths = d.site.callers if d.site is not None else (d.path,)
        owners = dict.fromkeys(sub_model_of(p, roots) for p in paths if p != "-")
        out.append(replace(d, sub_model=", ".join(o or "<root>" for o in owners)))
    return out


def _check_model_type(model: nn.Module, patchset: Patchset) -> str:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in patchset.model_types:
        remote = type(model).__module__.startswith(REMOTE_CODE)
        fix = (
            f"This model runs its own code ({type(model).__module__}), not transformers': scaffold a patchset for "
            f"it from its checkpoint folder (patch-engine scaffold --model {_checkpoint_folder(model)} "
            "--trust-remote-code), which "
            f"carries model_types [{model_type}]."
            if remote else
            "Use the patchset of this model's family, or add the type to model_types once verified."
        )
        raise ModelTypeMismatch(
            f"patchset {patchset.name!r} is for model_type {', '.join(patchset.model_types)}; "
            f"this model ({type(model).__name__}) is {model_type!r}. {fix}"
        )
    return str(model_type)


#: The package transformers imports ``trust_remote_code`` modeling files under.
REMOTE_CODE = "transformers_modules."


def _check_origin(patchset: Patchset, index: int, what: str, module_name: str) -> None:
    """Refuse a bundled patch on a remote-code class or function of the same name.

    Why: a bundled patchset was measured on transformers' own classes; a checkpoint's own code
    (``trust_remote_code``) may reuse a name (``Qwen2RMSNorm``) and compute something else, and
    a declaration patched onto it would change the model's numbers without a word.
    """
    from pathlib import Path

    from engine.loader.names import bundled_dir

    if not module_name.startswith(REMOTE_CODE) or not patchset.files:
        return
    if Path(patchset.files[0]).resolve().parent != bundled_dir().resolve():
        return
    raise ModelTypeMismatch(
        f"patches[{index}] of the bundled patchset {patchset.name!r} was measured on transformers' own {what}; "
        f"this model's {what} comes from its own code ({module_name}, loaded with trust_remote_code) and may "
        "compute something else under the same name. Patch it with no patchset named (engine.apply(model): its own "
        "code measured and verified on a tiny copy), write its own patchset (patch-engine scaffold --model "
        "<checkpoint folder> --trust-remote-code), or load the model without trust_remote_code to use transformers' "
        "classes"
    )


def _inactive(index: int, patch: Any) -> Decision:
    """The decision for a patch whose ``when`` range leaves out the installed transformers."""
    from engine.foundation.versions import installed_version, when_text

    is_module = isinstance(patch, ModulePatch)
    return Decision(
        path="-" if is_module else patch.function, cls=patch.target if is_module else "function", op=patch.op,
        patch_index=index, action="skip", kernel=None,
        reason=f"for {when_text(patch.when)} (installed: {installed_version()})", patch=patch,
    )


def _check_one_per_target(patchset: Patchset, active: list[int]) -> None:
    """Refuse two patches of one target whose ``when`` ranges both hold the installed version."""
    from engine.foundation.versions import installed_version, when_text
    from engine.loader import patch_location

    seen: dict[str, int] = {}
    for index in active:
        patch = patchset.patches[index]
        key = patch.target if isinstance(patch, ModulePatch) else f"function {patch.function}"
        if key in seen:
            first = patchset.patches[seen[key]]
            raise PatchsetError(
                f"{patch_location(patchset, index, 'when')}patches[{seen[key]}] and patches[{index}] both target "
                f"{key} on transformers {installed_version()} ({when_text(first.when) or 'no when'}; "
                f"{when_text(patch.when) or 'no when'}): make their `when` ranges disjoint"
            )
        seen[key] = index


def _located(exc: PatchError, patchset: Patchset, index: int) -> PatchError:
    """``exc`` with its message prefixed by ``file:line:`` of the patch it is about (if from a file)."""
    from engine.loader import patch_location

    key = getattr(exc, "patch_key", None) or _ERROR_KEYS.get(type(exc))
    where = shortened(patch_location(patchset, index, key))  # a 4,000-character path by its ends
    if where and exc.args and isinstance(exc.args[0], str) and not exc.args[0].startswith(where):
        exc.args = (where + exc.args[0], *exc.args[1:])
    return exc


#: The patch key an error is about, to point at its line rather than the patch's first line.
_ERROR_KEYS: dict[type, str] = {
    DeviceUnsupported: "kernel",
    MissingDependency: "kernel",
    KernelNotFound: "kernel",
}


def _verify_hint(patchset: Patchset) -> str:
    """A command that verifies ``patchset``, runnable as printed: its file as a quoted path (works from any folder)."""
    import shlex

    files = list(getattr(patchset, "files", None) or [])
    return f"patch-engine verify {shlex.quote(files[0])}" if files else "engine.verify(model, patchset)"


def _checkpoint_folder(model: nn.Module) -> str:
    """The model's checkpoint folder for a suggested command, quoted; ``FOLDER`` where it is not a local folder."""
    import os
    import shlex

    name = str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
    return shlex.quote(os.path.abspath(name)) if name and os.path.isdir(name) else "FOLDER"


def _check_drift(patch: Any, what: str, function: Callable[..., Any], hint: str = "patch-engine verify FILE") -> None:
    """Refuse when the patch pins a signature and the installed ``function`` has another."""
    if patch.signature is None:
        return
    from engine.foundation.drift import signature_changes, signature_text

    found = signature_text(function)
    changes = signature_changes(patch.signature, found)
    if changes:
        import transformers

        error = SignatureMismatch(
            f"{what} has drifted from the pinned signature: expected {patch.signature}, found {found} "
            f"({'; '.join(changes)}) in transformers {transformers.__version__}. "
            f"Re-verify the patch against this version ({hint}) and update `signature`, "
            "or install a transformers version that matches the pin."
        )
        error.patch_key = "signature"  # type: ignore[attr-defined]  (the line to point at)
        raise error


def _module_matches(model: nn.Module, target: str) -> list[tuple[str, nn.Module]]:
    return [(path, m) for path, m in model.named_modules() if type(m).__name__ == target]


def _words(name: str) -> set[str]:
    """CamelCase, digits and underscores split into lower-case words: ``RMSNormGated`` -> rms, norm, gated."""
    return {w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", name)}


def _similarity(a: str, b: str) -> float:
    """The better of character similarity and word-set overlap, so reordered words still match
    (``Qwen3_5GatedRMSNorm`` vs ``Qwen3_5RMSNormGated``)."""
    chars = difflib.SequenceMatcher(None, a.lower(), b.lower()).ratio()
    wa, wb = _words(a), _words(b)
    words = len(wa & wb) / len(wa | wb) if wa | wb else 0.0
    return max(chars, words)


def _closest_classes(model: nn.Module, name: str) -> str:
    classes = sorted({type(m).__name__ for m in model.modules()})
    exact = [c for c in classes if c.lower() == name.lower()]
    scored = sorted(((_similarity(name, c), c) for c in classes), key=lambda sc: (-sc[0], sc[1]))
    close = exact or [c for score, c in scored if score >= 0.75][:3]
    if close:
        return "did you mean " + " or ".join(repr(c) for c in close) + "?"
    related = [c for c in classes if any(k in c for k in ("Norm", "MLP", "Attention", "Net"))]
    return "classes in the model: " + ", ".join(related or classes[:20])


def _plan_module_patch(
    model: nn.Module, patchset: Patchset, index: int, patch: ModulePatch, op: ModuleOp, device: Device, mode: Mode
) -> Iterator[Decision]:
    matches = _module_matches(model, patch.target)
    if not matches:
        if patch.optional:
            yield Decision(
                path="-", cls=patch.target, op=op.name, patch_index=index, action="skip", kernel=None,
                reason="no module of this class (optional)", patch=patch,
            )
            return
        raise TargetNotFound(
            f"patches[{index}] ({op.name}) targets class {patch.target!r}, which matches no module of "
            f"{type(model).__name__}; {_closest_classes(model, patch.target)} "
            "(set `optional: true` if the class is legitimately absent in some configs)"
        )
    for cls in dict.fromkeys(type(module) for _, module in matches):
        _check_origin(patchset, index, f"class {cls.__name__}", cls.__module__)
        _check_drift(patch, f"{cls.__name__}.forward", cls.forward, _verify_hint(patchset))
    for _, module in matches:
        op.check_target(module, patch)
    provider, reason = resolve_kernel(
        op.name, patch.kernel, device, mode, patchset.on_unsupported, patch=op.kernel_settings(matches[0][1], patch),
        dtensor=dtensor_parameter(model, matches), dtype=_float_dtype(module for _, module in matches),
    )
    for path, module in matches:
        chosen = op.users_choice(model, module) if provider else None  # honoured: left as it is
        yield Decision(
            path=path, cls=type(module).__name__, op=op.name, patch_index=index,
            action="patch" if provider and not chosen else "skip", kernel=None if chosen or not provider else provider.name,
            reason=chosen or reason, patch=patch, provider=None if chosen else provider,
        )


def _float_dtype(modules: Iterable[nn.Module]) -> torch.dtype | None:
    """The dtype of the first floating parameter of ``modules`` (what their kernel computes in), if any."""
    for module in modules:
        for param in module.parameters():
            if param.is_floating_point():
                return param.dtype
    return None


def _plan_function_patch(
    model: nn.Module, patchset: Patchset, index: int, patch: FunctionPatch, op: FunctionOp, device: Device, mode: Mode
) -> Iterator[Decision]:
    sites: dict[str, tuple[dict[str, Any], list[str]]] = {}
    uncalled: dict[str, str] = {}  # namespace -> why its forwards never call it for this config
    for path, module in model.named_modules():
        namespace = _calls_name(type(module), patch.function)
        if namespace is not None and patch.function in namespace:
            why = never_calls(module, patch.function)  # Falcon with alibi: true never calls rope
            if why is None:
                sites.setdefault(namespace["__name__"], (namespace, []))[1].append(path)
            else:
                uncalled.setdefault(namespace["__name__"], why)
    if not sites and uncalled:
        for name, why in uncalled.items():
            yield Decision(
                path=f"{name}.{patch.function}", cls="function", op=op.name, patch_index=index, action="skip",
                kernel=None, reason=f"never called for this config: {why}", patch=patch,
            )
        return
    if not sites:
        if patch.optional:
            yield Decision(
                path=patch.function, cls="function", op=op.name, patch_index=index, action="skip", kernel=None,
                reason="no module of the model calls it (optional)", patch=patch,
            )
            return
        raise TargetNotFound(
            f"patches[{index}] ({op.name}) targets function {patch.function!r}, which no module of "
            f"{type(model).__name__} calls in its forward: patching it would change nothing"
        )
    callers = (model.get_submodule(p) for _, paths in sites.values() for p in paths)
    provider, reason = resolve_kernel(
        op.name, patch.kernel, device, mode, patchset.on_unsupported, patch=patch, dtype=_float_dtype(callers)
    )
    for name, (namespace, callers) in sites.items():
        _check_origin(patchset, index, f"function {patch.function}", name)
        original = _original_function(namespace[patch.function])
        _check_drift(patch, f"{name}.{patch.function}", original, _verify_hint(patchset))
        op.check_function(original, patch)
        site = FunctionSite(namespace=name, function=patch.function, callers=tuple(callers))
        yield Decision(
            path=f"{name}.{patch.function}", cls="function", op=op.name, patch_index=index,
            action="patch" if provider else "skip", kernel=provider.name if provider else None,
            reason=f"{reason}; called by {len(callers)} modules{_uncalled_note(uncalled)}", patch=patch,
            provider=provider, site=site,
        )


def _uncalled_note(uncalled: dict[str, str]) -> str:
    """The callers left out because their config never calls the function (Llama 4's no-rope layers), if any."""
    return "".join(f"; modules left out: {why}" for why in uncalled.values())


def _original_function(function: Callable[..., Any]) -> Callable[..., Any]:
    """The function itself: through our own router (another model may route it already) and a
    ``kernels`` ``Func`` module (see :mod:`engine.foundation.see_through`)."""
    return see_through(function)


def signature_of(function: Callable[..., Any]) -> str:
    return str(inspect.signature(see_through(function)))
