"""Which accelerator is current, found lazily and without importing vendor packages needlessly.

``torch_npu`` is imported only when it is installed, because merely importing it on a
machine without the CANN toolkit fails (and an installed-but-broken ``torch_npu`` must not
take the CPU path down with it).
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache

import torch

from engine.errors import DeviceNotAvailable, InvalidArgument
from engine.schema import Device

__all__ = ["as_device", "current_device", "is_present", "parameter_devices", "require_present", "resolve_device"]


@lru_cache(maxsize=1)
def current_device() -> Device:
    """The accelerator type this process would run on: npu, cuda, xpu, mps, or cpu.

    Cached: the answer does not change within a process. Plans for another device pass
    ``device=`` (plan, apply, verify, and the CLI's ``--device``).
    """
    try:
        if importlib.util.find_spec("torch_npu") is not None:
            import torch_npu  # noqa: F401  (registers torch.npu)

            if torch.npu.is_available():  # type: ignore[attr-defined]
                return Device.npu
    except Exception:  # an installed torch_npu without CANN: not an NPU machine (the npu kernel says why)
        pass
    if torch.cuda.is_available():
        return Device.cuda
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return Device.xpu
    if torch.backends.mps.is_available():
        return Device.mps
    return Device.cpu


def as_device(device: str | Device | torch.device | None) -> Device:
    """Normalize a user's ``device=`` argument; ``None`` means the current accelerator."""
    if device is None:
        return current_device()
    if isinstance(device, torch.device):
        device = device.type
    try:
        return Device(str(device).split(":")[0])
    except ValueError:
        valid = ", ".join(d.value for d in Device)
        raise InvalidArgument(f"unknown device {device!r}; expected one of {valid}") from None


def is_present(device: Device) -> bool:
    """Whether this machine has a ``device`` to run on (the CPU always)."""
    if device is Device.cpu or device is current_device():
        return True
    if device is Device.cuda:
        return torch.cuda.is_available()
    if device is Device.xpu:
        return hasattr(torch, "xpu") and torch.xpu.is_available()
    if device is Device.mps:
        return torch.backends.mps.is_available()
    npu = getattr(torch, "npu", None)  # registered by importing torch_npu (current_device() did, if it can)
    try:
        return bool(npu is not None and npu.is_available())
    except Exception:  # a torch_npu without CANN
        return False


def present_devices() -> list[str]:
    """The devices of this machine, as ``torch.device`` strings: ``cpu`` and each accelerator's indices."""
    found = ["cpu"]
    for kind in ("cuda", "xpu", "npu", "mps"):
        device = Device(kind)
        if is_present(device):
            module = getattr(torch, kind, None)
            count = getattr(module, "device_count", lambda: 1)() if module is not None else 1
            found += [kind] if kind == "mps" else [f"{kind}:{i}" for i in range(max(int(count), 1))]
    return found


def parameter_devices(model: torch.nn.Module) -> list[str]:
    """The device types the model's parameters and buffers are on, ``meta`` left out (offloaded weights)."""
    found: dict[str, None] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.device.type != "meta":
            found[tensor.device.type] = None
    return list(found)


def resolve_device(model: torch.nn.Module, device: str | Device | torch.device | None) -> Device:
    """The device to plan for: the one asked for, else where the model's parameters are, else the accelerator.

    Why the parameters first: a model loaded on the CPU of a GPU machine runs its forward on
    the CPU; kernels chosen for the accelerator would fail there (HF ``kernels`` infers the
    device from the parameters too).
    """
    if device is not None:
        return as_device(device)
    where = parameter_devices(model)
    if len(where) == 1:
        try:
            return Device(where[0])
        except ValueError:  # a device type we plan no kernels for: the accelerator's list applies
            pass
    return current_device()


def require_present(device: Device, model: torch.nn.Module | None = None) -> None:
    """Raise :class:`DeviceNotAvailable` when this machine has no ``device``; say where the model is and what to do."""
    if is_present(device):
        return
    where = parameter_devices(model) if model is not None else []
    model_part = f"the model's parameters are on {' and '.join(where)}; " if where else ""
    use = where[0] if len(where) == 1 else current_device().value
    raise DeviceNotAvailable(
        f"device {device.value!r} was requested, but this machine has no {device.value} device "
        f"(current accelerator: {current_device().value}); {model_part}"
        f"use device={use!r} (or leave device unset to use where the model is), or see the decisions for "
        f"{device.value} without patching: engine.plan(model, patchset, device={device.value!r})"
    )
