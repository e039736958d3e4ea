"""torch's process-wide settings a patch may leave changed: modes, flags and the stacks of modes it enters.

Why: a patch is code run in the user's process. Besides names rebound (:mod:`engine.auditing.process_state`),
it may turn gradients off for the process (``torch.set_grad_enabled(False)``), change the default dtype,
the fp32 matmul precision or determinism, or enter a ``TorchFunctionMode`` / ``TorchDispatchMode`` and never
leave it (every op of every model then goes through it). None of these is a name, so no snapshot of
namespaces sees them; each is read before the patch and put back after the audit like a name.

Each :class:`Setting` reads and writes one of them; :func:`settings` lists them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Setting", "settings"]


@dataclass(frozen=True)
class Setting:
    """One process-wide setting: ``get()`` its value now, ``set(value)`` to put a value back."""

    name: str   # as a user writes it: "torch.is_grad_enabled()"
    get: Callable[[], Any]
    set: Callable[[Any], None]


def _function_modes() -> tuple[Any, ...]:
    return tuple(torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack()))


def _set_function_modes(modes: tuple[Any, ...]) -> None:
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()
    for mode in modes:
        torch._C._push_on_torch_function_stack(mode)


def _dispatch_modes() -> tuple[Any, ...]:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return tuple(_get_current_dispatch_mode_stack())


def _set_dispatch_modes(modes: tuple[Any, ...]) -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    while _get_current_dispatch_mode_stack():
        _pop_mode()
    for mode in modes:
        _push_mode(mode)


def _deterministic() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _anomaly() -> tuple[bool, bool]:
    return torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()


def settings() -> list[Setting]:
    """The settings an audit reads before a patch and puts back after it (the mode stacks last: a setting's
    own setter may enter or leave a mode)."""
    return [
        Setting("torch.is_grad_enabled()", torch.is_grad_enabled, torch.set_grad_enabled),
        Setting("torch.get_default_dtype()", torch.get_default_dtype, torch.set_default_dtype),
        Setting("torch.get_float32_matmul_precision()", torch.get_float32_matmul_precision,
                torch.set_float32_matmul_precision),
        Setting("torch.are_deterministic_algorithms_enabled()", _deterministic,
                lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
        Setting("torch.is_anomaly_enabled()", _anomaly, lambda v: torch.set_anomaly_enabled(*v)),
        Setting("torch.is_autocast_enabled('cpu')", lambda: torch.is_autocast_enabled("cpu"),
                lambda v: torch.set_autocast_enabled("cpu", v)),
        Setting("the torch function mode stack", _function_modes, _set_function_modes),
        Setting("the torch dispatch mode stack", _dispatch_modes, _set_dispatch_modes),
    ]


def same(before: Any, after: Any) -> bool:
    """Whether a setting is as it was: by value, and a stack of modes by the identity of each mode."""
    if isinstance(before, tuple) and isinstance(after, tuple):
        return len(before) == len(after) and all(b is a for b, a in zip(before, after, strict=True))
    return bool(before == after)
