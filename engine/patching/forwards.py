"""Installing a forward on one module instance *beneath* any wrapper a library put there.

Why: libraries wrap instance forwards too. accelerate's hooks (``cpu_offload``,
``dispatch_model``, ``from_pretrained(device_map=...)``) set ``module.forward`` to a
``functools.partial`` that moves weights in, calls ``module._old_forward`` and moves them out;
transformers' tensor parallelism sets ``module.forward = tp_forward``, a closure over the
forward that was there, which registers the gradient all-reduce of replicated norms. An
engine that simply assigned ``module.forward`` would throw those wrappers away: the
offloaded forward then runs on meta weights, and TP gradients silently miss their
all-reduce. The same wrappers are also added *after* a patch (accelerate hooks on a
patched model), and ``revert`` must then leave them in place.

So a module's forward is seen as a chain of *slots*: the instance attribute
``forward`` at the top, then, for each wrapper we can see through, the place it keeps the
forward it calls (accelerate: the ``_old_forward`` attribute; a closure such as TP's: the
closure cell holding the module's previous forward). :func:`install` walks down to the
bottom (the class forward, or nothing) and puts the new forward there; :func:`restore`
finds it again wherever it is now (wrappers may have been added or removed since) and puts
back exactly what it replaced. A wrapper the engine cannot see through is refused before
anything changes (:class:`~engine.errors.ForwardWrapped`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from types import CellType, FunctionType, MethodType
from typing import Any

from torch import nn

from engine.errors import ForwardWrapped
from engine.patching.bound_forward import MISSING, PatchedForward

__all__ = ["ForwardInstall", "bottom_slot", "install", "is_ours"]

#: accelerate's hook convention: the instance forward is a wrapper calling this attribute.
_ACCELERATE_INNER = "_old_forward"
_MAX_DEPTH = 16
@dataclass(frozen=True)
class _Slot:
    """One place a module's forward lives: an instance attribute or a wrapper's closure cell."""

    module: nn.Module
    attr: str | None = None  # "forward" or "_old_forward"
    cell: CellType | None = None

    def get(self) -> Any:
        if self.cell is not None:
            return self.cell.cell_contents
        return self.module.__dict__.get(self.attr, MISSING)  # type: ignore[arg-type]

    def set(self, value: Any) -> None:
        if self.cell is not None:
            self.cell.cell_contents = _bound_if_missing(self.module, value)
        elif value is MISSING and self.attr == "forward":
            self.module.__dict__.pop("forward", None)
        else:
            # Beneath a wrapper, 'nothing' means what the wrapper would have captured: the class forward.
            self.module.__dict__[self.attr] = _bound_if_missing(self.module, value)  # type: ignore[index]

    def describe(self) -> str:
        if self.cell is not None:
            return "a closure cell of a wrapper"
        return f"the instance attribute {self.attr!r}"


def _bound_if_missing(module: nn.Module, value: Any) -> Any:
    return MethodType(type(module).forward, module) if value is MISSING else value


def is_ours(forward: Any) -> bool:
    """Whether ``forward`` is one the engine installed (a :class:`PatchedForward`)."""
    return isinstance(forward, PatchedForward)


def _is_class_forward(module: nn.Module, forward: Any) -> bool:
    return (
        isinstance(forward, MethodType)
        and forward.__self__ is module
        and forward.__func__ is getattr(type(module), "forward", None)
    )


def _calls_module(module: nn.Module, value: Any) -> bool:
    """Whether ``value`` is a forward of ``module``: a bound method or a partial over it."""
    if isinstance(value, MethodType):
        return value.__self__ is module
    if isinstance(value, functools.partial):
        return bool(value.args) and value.args[0] is module
    return False


def _inner_slot(module: nn.Module, forward: Any) -> _Slot | None:
    """The slot holding the forward that the wrapper ``forward`` calls, or None if it is opaque."""
    if "_hf_hook" in module.__dict__ and _ACCELERATE_INNER in module.__dict__ and _calls_module(module, forward):
        return _Slot(module, attr=_ACCELERATE_INNER)
    function = forward
    if isinstance(function, functools.partial):
        function = function.func
    if isinstance(function, MethodType):
        function = function.__func__
    if not isinstance(function, FunctionType) or not function.__closure__:
        return None
    cells = [c for c in function.__closure__ if _cell_holds_forward(module, c)]
    return _Slot(module, cell=cells[0]) if len(cells) == 1 else None


def _cell_holds_forward(module: nn.Module, cell: CellType) -> bool:
    try:
        value = cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return _calls_module(module, value)


def _chain(module: nn.Module) -> Iterator[tuple[_Slot, Any]]:
    """Every (slot, forward in it) from the instance attribute down, as far as wrappers can be seen through."""
    slot: _Slot | None = _Slot(module, attr="forward")
    for _ in range(_MAX_DEPTH):
        if slot is None:
            return
        value = slot.get()
        yield slot, value
        if value is MISSING or _is_class_forward(module, value) or is_ours(value):
            return
        slot = _inner_slot(module, value)


def bottom_slot(module: nn.Module, path: str = "") -> _Slot:
    """Where a new forward goes: beneath every wrapper, replacing the class forward (or ours).

    Raises:
        ForwardWrapped: the instance forward was replaced by something the engine cannot see
            through (e.g. another library's patch), so patching would throw it away.
    """
    last: tuple[_Slot, Any] | None = None
    for last in _chain(module):
        pass
    assert last is not None
    slot, value = last
    if value is MISSING or _is_class_forward(module, value) or is_ours(value):
        return slot
    where = path or type(module).__name__
    raise ForwardWrapped(
        f"{where} ({type(module).__name__}): its forward was replaced by {_name(value)} in {slot.describe()}, "
        "which the engine cannot see through, so patching would discard it. Undo the other patch first "
        "(e.g. revert another kernel library's monkey-patch), or apply the patchset before it."
    )


def _name(value: Any) -> str:
    function = getattr(value, "func", value)
    function = getattr(function, "__func__", function)
    return getattr(function, "__qualname__", None) or repr(value)


@dataclass
class ForwardInstall:
    """One forward the engine installed; :meth:`undo` puts back exactly what it replaced."""

    module: nn.Module
    installed: PatchedForward
    previous: Any  # what the slot held before, or MISSING

    def _mine(self, value: Any) -> bool:
        # By binding: an unpickled forward is rebuilt as a new object with the same binding.
        return value is self.installed or (isinstance(value, PatchedForward) and value.binding is self.installed.binding)

    def undo(self) -> bool:
        """Restore, wherever our forward is now; ``False`` if a wrapper hides it (it stays)."""
        for slot, value in _chain(self.module):
            if self._mine(value):
                slot.set(self.previous)
                return True
        return False


def install(module: nn.Module, slot: _Slot, forward: PatchedForward) -> ForwardInstall:
    """Put ``forward`` in ``slot`` (from :func:`bottom_slot`); the record restores what was there."""
    record = ForwardInstall(module, forward, slot.get())
    slot.set(forward)
    return record
