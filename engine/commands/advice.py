"""What a command's error suggests, in the command line's own words: flags and commands that run as printed.

Why: the engine's errors are written for Python (``device='cpu'``, ``engine.plan(model, ...)``),
and a user of ``patch-engine verify qwen3 --device cuda`` who is told to pass ``device='cpu'``
has nowhere to pass it. Each suggestion here is a whole command, quoted for a shell, that
``tests/test_advice.py`` runs as printed.
"""

from __future__ import annotations

import shlex

from engine.errors import DeviceNotAvailable

__all__ = ["device_missing"]


def device_missing(device: str, here: str, target: list[str], *, interpret: bool = True) -> DeviceNotAvailable:
    """``--device DEVICE`` on a machine without it: run here, or the dry run and (CUDA) the interpreted plan.

    Args:
        device: the device asked for (``cuda``).
        here: this machine's device (``cpu``).
        target: what the command was given to work on, as typed: ``["qwen3"]``, ``["--model-type", "olmo"]``.
        interpret: whether ``verify --interpret`` applies (a patchset on a tiny model; not a checkpoint).
    """
    named = "".join(f" {shlex.quote(part)}" for part in target)
    text = (f"--device {device}: this machine has no {device} device (current accelerator: {here}); leave --device "
            f"out (or give --device {here}) to run here, or see the decisions for {device} without running them: "
            f"patch-engine plan{named} --device {device}")
    if device == "cuda" and interpret:
        text += f"; or run the CUDA plan's Triton kernels on this CPU: patch-engine verify{named} --interpret"
    return DeviceNotAvailable(text)
