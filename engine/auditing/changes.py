"""What a foreign patch changed in one model: each module's class or forward, each function its forwards call.

Why by comparison and not by asking the stack: no stack says what it did (Liger returns
``None``, twinkle the model, LlamaFactory's plugins the model), and what a stack believes it
patched is what an audit must not trust (8 of twinkle's 65 default entries name classes
transformers does not have). The patch runs on a copy of the model made just before it; the
copy's modules are compared with the model's, path by path, and the process's watched names
with their snapshot (:mod:`engine.auditing.process_state`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from engine.auditing.process_state import ProcessChange, describe_object

__all__ = ["Change", "find_changes"]


@dataclass(frozen=True)
class Change:
    """One change a patch made, as it bears on one model.

    ``judged``: ``"module"`` (its output on its recorded inputs), ``"function"`` (likewise),
    ``"model"`` (it holds the decoder layers, or has no record: the whole-model checks judge it)
    or ``"none"`` (it does not reach this model: a class name rebound for models built later).
    """

    path: str
    cls: str
    kind: str
    detail: str
    judged: str


def _function(value: Any) -> Any:
    """The plain function behind a bound method (a deep copy rebinds the method, not its function)."""
    return getattr(value, "__func__", value)


def find_changes(
    original: nn.Module, patched: nn.Module, process: list[ProcessChange],
    functions: dict[tuple[str, str], Any], recorded: set[Any],
) -> list[Change]:
    """Every change ``patched`` (a copy of ``original`` a patch ran on) and the process show.

    ``functions``: the module-level functions the model's forwards call, by ``(module, name)``;
    ``recorded``: the paths and function keys the original's run recorded (judged one by one).
    """
    changed_classes: dict[str, list[ProcessChange]] = {}
    for change in process:
        if change.kind == "class attribute" and (callable(change.after) or callable(change.before)):
            changed_classes.setdefault(change.owner, []).append(change)
    found: list[Change] = []
    mine = dict(patched.named_modules())
    for path, module in original.named_modules():
        cls = type(module)
        judged = "module" if path in recorded else "model"
        other = mine.get(path)
        if other is None:
            found.append(Change(path, cls.__name__, "module removed", "the patched model has no module here", "model"))
            continue
        if type(other) is not cls:
            detail = f"{cls.__name__} -> {describe_object(type(other))}"
            found.append(Change(path, cls.__name__, "class swapped", detail, judged))
            continue
        before, after = _function(module.__dict__.get("forward")), _function(other.__dict__.get("forward"))
        if before is not after:
            found.append(Change(path, cls.__name__, "forward replaced", describe_object(after), judged))
            continue
        for klass in cls.__mro__:
            owner = f"{klass.__module__}.{klass.__qualname__}"
            hits = changed_classes.get(owner, [])
            if hits:
                what = ", ".join(f"{c.name} -> {describe_object(c.after)}" for c in hits)
                found.append(Change(path, cls.__name__, "class attribute replaced (process-wide)",
                                    f"{klass.__qualname__}.{what}", judged))
                break
    theirs = dict(original.named_modules())
    for path, other in mine.items():
        if path not in theirs:
            found.append(Change(path, type(other).__name__, "module added", describe_object(type(other)), "model"))
    used_classes = {f"{k.__module__}.{k.__qualname__}" for m in original.modules() for k in type(m).__mro__}
    own_modules = {type(m).__module__ for m in original.modules()}
    for change in process:
        key = (change.owner, change.name)
        if change.kind == "function" and key in functions:
            found.append(Change(change.where, "function", "function rebound", describe_object(change.after),
                                "function" if key in recorded else "model"))
        elif change.kind == "class attribute" and change.owner in used_classes:
            continue  # reported with each module of that class above
        elif change.kind == "registry entry":  # looked up by key at run time (an attention implementation)
            found.append(Change(change.where, "-", "registry entry", change.describe(), "model"))
        elif _elsewhere(change, own_modules):
            found.append(Change(change.where, "-", "process-wide", change.describe() + _reach(change), "none"))
        else:  # a library function the model's code may reach (Liger's cross_entropy: the loss calls it)
            found.append(Change(change.where, "-", "library function rebound", change.describe(), "model"))
    return found


def _elsewhere(change: ProcessChange, own_modules: set[str]) -> bool:
    """Whether a process-wide change cannot reach this model: a class name (read when a model is built), or a
    name in a modeling module none of this model's classes comes from (another family's)."""
    if isinstance(change.before, type) or isinstance(change.after, type):
        return True
    module = change.owner if change.kind == "function" else change.owner.rsplit(".", 1)[0]
    return module.startswith("transformers.models.") and module not in own_modules or module in own_modules


def _reach(change: ProcessChange) -> str:
    """Why a process-wide change does not reach this model (it is still reported, and undone after the audit)."""
    if isinstance(change.before, type) or isinstance(change.after, type):
        return " (a class name: models built after the patch get it, this one does not)"
    return " (this model's forwards do not call it)"
