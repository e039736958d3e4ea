"""Kernel choice: which provider computes an op on a device, in a mode, for a patch's settings.

Part of planning, kept apart from the walk over the model: it reads only the registry and
the patch, so a benchmark or a test can ask "what would `auto` pick here" without a model.
``kernel: auto`` walks ``registry.AUTO_ORDER`` (data) and says in its reason what it passed
over and why; a declared kernel that cannot run is an error, a skip or a fallback to torch,
as the patchset's ``on_unsupported`` says.
"""

from __future__ import annotations

from typing import Any, Literal

from engine.errors import DeviceUnsupported, DTensorUnsupported, KernelNotFound, MissingDependency
from engine.kernels import registry
from engine.kernels.registry import KernelProvider
from engine.kernels.vendor_dtypes import unverified
from engine.schema import Device, OnUnsupported

__all__ = ["resolve_kernel"]

Mode = Literal["training", "inference"]


def resolve_kernel(
    op: str, spec: Any, device: Device, mode: Mode, on_unsupported: OnUnsupported, *, patch: Any = None,
    dtensor: str | None = None, dtype: Any = None,
) -> tuple[KernelProvider | None, str]:
    """Pick the provider for ``op`` on ``device``: ``(provider or None if skipped, why)``.

    ``patch`` (optional) lets a provider refuse settings whose numerics it does not reproduce;
    ``dtensor`` (optional, from :func:`engine.runtime.placements.dtensor_parameter`) names a DTensor
    parameter of the targets, which only providers declaring ``dtensor=True`` accept;
    ``dtype`` (optional) the targets' dtype: ``auto`` passes over a kernel measured to fail the
    verifier in it (:mod:`engine.kernels.vendor_dtypes`); a declared one is kept, with a warning.
    """
    choice = spec if isinstance(spec, str) else spec.get(device, "auto")
    if choice == "auto":
        return _resolve_auto(op, device, mode, patch, dtensor, dtype)
    provider, why = _resolve_declared(op, choice, device, mode, on_unsupported, patch, dtensor)
    if provider is not None and provider.name == choice and (bad := unverified(choice, op, device.value, dtype)):
        why += f" (warning: {bad}; verify measures the difference)"
    return provider, why


def _resolve_declared(
    op: str, choice: str, device: Device, mode: Mode, on_unsupported: OnUnsupported, patch: Any, dtensor: str | None
) -> tuple[KernelProvider | None, str]:
    provider = registry.get(choice, op)
    problem: Exception | None = None
    if dtensor is not None and not provider.dtensor:
        problem = DTensorUnsupported(
            f"{choice} does not take DTensor inputs, and {dtensor} (tensor parallel); "
            "choose a kernel that does (torch) or `kernel: auto`, which picks one."
        )
    elif device not in provider.devices:
        problem = DeviceUnsupported(f"{choice} requires {provider.device_list()}, current accelerator is {device.value}.")
    elif mode == "training" and not provider.has_backward:
        problem = DeviceUnsupported(
            f"{choice} has no backward for {op}, and the plan is for training; "
            "plan with mode='inference' or choose a kernel with a backward."
        )
    elif (unfit := _unfit(provider, patch)) is not None:
        problem = DeviceUnsupported(f"{choice} cannot compute {op} as declared: {unfit}; choose another kernel.")
    else:
        try:
            provider.check_dependencies()
        except MissingDependency as exc:
            problem = exc
    if problem is None:
        return provider, f"{choice} (declared)" + (f" ({provider.rule_note()})" if provider.rule_note else "")
    if on_unsupported is OnUnsupported.error:
        raise problem
    if on_unsupported is OnUnsupported.skip:
        return None, f"skipped: {problem}"
    return registry.get("torch", op), f"fallback to torch: {problem}"


def _unfit(provider: KernelProvider, patch: Any) -> str | None:
    """Why ``provider`` does not reproduce ``patch``'s declared numerics, or ``None``."""
    if patch is None or provider.supports is None:
        return None
    return provider.supports(patch)


def _resolve_auto(
    op: str, device: Device, mode: Mode, patch: Any = None, dtensor: str | None = None, dtype: Any = None
) -> tuple[KernelProvider, str]:
    passed: list[str] = []
    for name in registry.AUTO_ORDER.get(device, ("torch",)):
        try:
            provider = registry.get(name, op)
        except KernelNotFound:
            continue
        if device not in provider.devices:
            continue
        if dtensor is not None and not provider.dtensor:
            passed.append(f"{name}: takes no DTensor inputs ({dtensor})")
            continue
        if mode == "training" and not provider.has_backward:
            passed.append(f"{name}: no backward")
            continue
        if (unfit := _unfit(provider, patch)) is not None:
            passed.append(f"{name}: {unfit}")
            continue
        if (bad := unverified(name, op, device.value, dtype)) is not None:
            passed.append(f"{name}: {bad}")
            continue
        try:
            provider.check_dependencies()
        except MissingDependency as exc:
            passed.append(f"{name}: {exc}")
            continue
        why = f"auto: first available for {device.value}"
        if provider.rule_note is not None:
            why += f" ({provider.rule_note()})"
        return provider, why + (f" (passed over {'; '.join(passed)})" if passed else "")
    raise KernelNotFound(f"no kernel for op {op!r} runs on {device.value} in {mode}")
