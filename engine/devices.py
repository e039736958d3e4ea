"""Which accelerator is current, found lazily and without importing vendor packages needlessly.

``torch_npu`` is imported only when it is installed, because merely importing it on a
machine without the CANN toolkit fails (and an installed-but-broken ``torch_npu`` must not
take the CPU path down with it).
"""

from __future__ import annotations

import importlib.util
from functools import lru_cache

import torch

from engine.schema import Device

__all__ = ["as_device", "current_device"]


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
        raise ValueError(f"unknown device {device!r}; expected one of {valid}") from None
