"""What a foreign patch changed in one model: classes, forwards, submodules, parameters, config, functions.

Why by comparison and not by asking the stack: no stack says what it did (Liger returns
``None``, twinkle the model, LlamaFactory's plugins the model), and what a stack believes it
patched is what an audit must not trust (8 of twinkle's 65 default entries name classes
transformers does not have). The patch runs on a copy of the model made just before it; the
copy's modules are compared with the model's, path by path (class, forward, the module object
itself, its hooks and plain attributes, each parameter's and buffer's values, identity and gradient
hooks, weight ties, config fields), and the
process's watched names with their snapshot (:mod:`engine.auditing.process_state`): every
function the forwards can reach, through the globals of the functions they call, transitively
(``rotate_half`` rebound reaches the model through ``apply_rotary_pos_emb``'s globals).

Detection only says where to look and what explains a difference: the whole model is judged
whatever it finds (:mod:`engine.auditing.run`).
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.auditing.process_state import ProcessChange, describe_object
from engine.runtime.hub_functions import torch_body

__all__ = ["Change", "find_changes", "identities", "reachable_functions"]

#: Packages whose functions are machinery, not a model's math: not followed when walking globals.
_LIBRARY = frozenset({"torch", "transformers", "engine", "einops", "numpy", "triton", *sys.stdlib_module_names})


@dataclass(frozen=True)
class Change:
    """One change a patch made, as it bears on one model.

    ``judged``: ``"module"`` (its output on its recorded inputs), ``"function"`` (likewise),
    ``"through"`` (a function reached only through another's globals: the recorded caller ``via``
    is run again with it in place), ``"fact"`` (it differs by what it is: a parameter's ``requires_grad``
    switched), ``"model"`` (the whole-model checks judge it) or ``"none"``
    (it does not reach this model: a class name rebound for models built later).
    """

    path: str
    cls: str
    kind: str
    detail: str
    judged: str
    via: Any = None


def _function(value: Any) -> Any:
    """The plain function behind a bound method (a deep copy rebinds the method, not its function)."""
    return getattr(value, "__func__", value)


def identities(model: nn.Module) -> dict[str, Any]:
    """The identity of every module, parameter and buffer of ``model`` by path (taken on the copy before the patch)."""
    ids: dict[str, Any] = {}
    for path, module in model.named_modules():
        ids[path] = id(module)
        for name, value in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            ids[f"{path}.{name}" if path else name] = id(value)
    return ids


def find_changes(
    original: nn.Module, patched: nn.Module, process: list[ProcessChange],
    functions: dict[tuple[str, str], Any], recorded: set[Any], copied: dict[str, Any] | None = None,
) -> list[Change]:
    """Every change ``patched`` (a copy of ``original`` a patch ran on) and the process show.

    ``functions``: the module-level functions the model's forwards call, by ``(module, name)``;
    ``recorded``: the paths and function keys the original's run recorded (judged one by one);
    ``copied``: :func:`identities` of the copy before the patch ran (objects the patch put in place).
    """
    changed_classes: dict[str, list[ProcessChange]] = {}
    for change in process:
        if change.kind == "class attribute" and (callable(change.after) or callable(change.before)):
            changed_classes.setdefault(change.owner, []).append(change)
    found: list[Change] = []
    mine = dict(patched.named_modules())
    replaced: list[str] = []
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
            replaced.append(path)
            continue
        if copied is not None and path in copied and copied[path] != id(other):
            found.append(Change(path, cls.__name__, "submodule replaced",
                                f"another {cls.__name__} object put at {path or '<model>'}", judged))
            replaced.append(path)
            continue
        before, after = _function(module.__dict__.get("forward")), _function(other.__dict__.get("forward"))
        if before is not after:
            found.append(Change(path, cls.__name__, "forward replaced", describe_object(after), judged))
            continue
        hooks = _hooks_added(module, other)
        if hooks:  # judged through the module's call, which runs them (a forward alone would not)
            found.append(Change(path, cls.__name__, "hooks added", hooks, judged))
        attributes = _attributes_changed(module, other)
        if attributes:  # an instance's own number its forward reads (variance_epsilon)
            found.append(Change(path, cls.__name__, "attributes changed", attributes, judged))
        for klass in cls.__mro__:
            owner = f"{klass.__module__}.{klass.__qualname__}"
            hits = changed_classes.get(owner, [])
            if hits:
                what = ", ".join(f"{c.name} -> {describe_object(c.after)}" for c in hits)
                found.append(Change(path, cls.__name__, "class attribute replaced (process-wide)",
                                    f"{klass.__qualname__}.{what}", judged))
                break
    found += _tensor_changes(original, patched, recorded, copied or {}, replaced)
    found += _config_changes(original, patched)
    theirs = dict(original.named_modules())
    for path, other in mine.items():
        if path not in theirs:
            found.append(Change(path, type(other).__name__, "module added", describe_object(type(other)), "model"))
    found += _process_changes(original, process, functions, recorded)
    return found


#: The module hook tables a call runs (torch.nn.Module.__call__), by what the report calls them.
_HOOK_TABLES = (("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook"),
                ("_backward_pre_hooks", "backward pre-hook"), ("_backward_hooks", "backward hook"))
#: Instance attributes a forward reads as numbers or flags: compared by value (tensors, modules and
#: private state are compared elsewhere or are torch's bookkeeping).
_PLAIN = (bool, int, float, str, type(None))


def _new_hooks(before: Any, after: Any, table: str) -> list[Any]:
    """The hooks in ``after``'s hook table (a module's or a tensor's) that ``before``'s does not hold, by identity."""
    held = [_function(h) for h in (getattr(before, table, None) or {}).values()]
    return [_function(h) for h in (getattr(after, table, None) or {}).values()
            if not any(_function(h) is k for k in held)]


def _hooks_added(module: nn.Module, other: nn.Module) -> str:
    """The hooks ``other`` (the patched copy) runs that ``module`` does not: a hook that scales an output
    changes the model as surely as a new forward, and no class, forward or weight shows it."""
    return ", ".join(f"{name} {describe_object(hook)}" for table, name in _HOOK_TABLES
                     for hook in _new_hooks(module, other, table))


def _attributes_changed(module: nn.Module, other: nn.Module) -> str:
    """Plain public instance attributes (numbers, flags, strings) whose value the patch changed, added or removed."""
    def plain(m: nn.Module) -> dict[str, Any]:
        return {k: v for k, v in vars(m).items()
                if not k.startswith("_") and k != "training" and isinstance(v, _PLAIN)}

    before, after = plain(module), plain(other)
    def same(key: str) -> bool:
        b, a = before.get(key, _PLAIN), after.get(key, _PLAIN)
        return b is a or b == a  # identity first: a NaN left as it was is not a change

    changed = [key for key in sorted(before.keys() | after.keys()) if not same(key)]
    return "; ".join(f"{key} {before.get(key, '(none)')!r} -> {after.get(key, '(none)')!r}" for key in changed)


def _gradient_hooks(name: str, before: torch.Tensor, after: torch.Tensor) -> str:
    """Hooks on a parameter's gradient the patch registered (``weight.register_hook(lambda g: g * 2)``)."""
    added = [describe_object(hook) for table in ("_backward_hooks", "_post_accumulate_grad_hooks")
             for hook in _new_hooks(before, after, table)]
    return f"parameter {name}: gradient hook {', '.join(added)}" if added else ""


def _tensor_changes(original: nn.Module, patched: nn.Module, recorded: set[Any], copied: dict[str, Any],
                    replaced: list[str]) -> list[Change]:
    """Parameters and buffers whose values, shape, dtype or identity changed, and weight ties made or broken."""
    found: list[Change] = []
    mine = dict(patched.named_modules())
    for path, module in original.named_modules():
        other = mine.get(path)
        if other is None or any(path == r or path.startswith(f"{r}.") or not r for r in replaced):
            continue
        what: list[str] = []
        hooked: list[str] = []
        switched: list[str] = []
        for kind, before, after in (("parameter", dict(module.named_parameters(recurse=False)),
                                     dict(other.named_parameters(recurse=False))),
                                    ("buffer", dict(module.named_buffers(recurse=False)),
                                     dict(other.named_buffers(recurse=False)))):
            for name in sorted(before.keys() | after.keys()):
                b, a = before.get(name), after.get(name)
                full = f"{path}.{name}" if path else name
                if a is None or b is None:
                    what.append(f"{kind} {name} {'removed' if a is None else 'added'}")
                elif a.shape != b.shape or a.dtype != b.dtype:
                    what.append(f"{kind} {name} {tuple(b.shape)} {b.dtype} -> {tuple(a.shape)} {a.dtype}")
                elif not torch.equal(a.detach().to(b.device), b.detach()):
                    diff = float((a.detach().to(b.device).double() - b.detach().double()).abs().max())
                    what.append(f"{kind} {name} values changed (max |change| {diff:.2g})")
                elif full in copied and copied[full] != id(a):
                    what.append(f"{kind} {name} replaced by another tensor of the same values")
                if a is not None and b is not None and kind == "parameter" and a.requires_grad != b.requires_grad:
                    switched.append(f"parameter {name} requires_grad {b.requires_grad} -> {a.requires_grad}")
                if a is not None and b is not None and kind == "parameter" and (hooks := _gradient_hooks(name, b, a)):
                    hooked.append(hooks)
        if what:
            found.append(Change(path, type(module).__name__, "weights changed", "; ".join(what),
                                "module" if path in recorded else "model"))
        if switched:  # a weight training no longer updates (or now does): a fact, not a number to judge
            found.append(Change(path, type(module).__name__, "requires_grad changed", "; ".join(switched), "fact"))
        if hooked:  # the module's backward check sees them (its gradients go through the same tensors)
            found.append(Change(path, type(module).__name__, "gradient hooks added", "; ".join(hooked),
                                "module" if path in recorded else "model"))
    ties = _ties(original)
    mine_ties = _ties(patched)
    if ties != mine_ties:
        broken = sorted(" = ".join(t) for t in ties - mine_ties)
        made = sorted(" = ".join(t) for t in mine_ties - ties)
        detail = "; ".join([*(f"tie broken: {t}" for t in broken), *(f"tie made: {t}" for t in made)])
        found.append(Change("", type(original).__name__, "weight ties changed", detail, "model"))
    return found


def _ties(model: nn.Module) -> set[tuple[str, ...]]:
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return {tuple(sorted(names)) for names in groups.values() if len(names) > 1}


def _config_changes(original: nn.Module, patched: nn.Module) -> list[Change]:
    """Config fields the patch changed (``_attn_implementation`` included: it picks the attention that runs)."""
    a, b = getattr(original, "config", None), getattr(patched, "config", None)
    if a is None or b is None:
        return []
    try:
        before, after = a.to_dict(), b.to_dict()
    except Exception:  # noqa: BLE001  (a config that cannot be serialised is compared by its attention only)
        before, after = {}, {}
    for cfg, out in ((a, before), (b, after)):
        out["_attn_implementation"] = getattr(cfg, "_attn_implementation", None)
    found = []
    for key in sorted(before.keys() | after.keys()):
        if before.get(key) != after.get(key):
            found.append(Change(f"config.{key}", "config", "config field changed",
                                f"{before.get(key)!r} -> {after.get(key)!r}", "model"))
    return found


def reachable_functions(model: nn.Module, functions: dict[tuple[str, str], Any],
                        recorded: set[Any]) -> dict[tuple[str, str], Any]:
    """Every model function the forwards reach through globals, transitively, -> the recorded caller to judge it by.

    The caller is a recorded function key, or the path of a recorded module whose forward reaches it
    (``None`` where no recorded caller reaches it: the whole-model checks judge it).
    """
    reach: dict[tuple[str, str], Any] = {}
    todo: list[tuple[Any, Any]] = []
    entries: dict[type, Any] = {}
    for path, module in model.named_modules():  # one recorded instance per class judges what its forward reaches
        if entries.get(type(module)) is None:
            entries[type(module)] = path if path in recorded else None
    for cls, entry in entries.items():
        forward = getattr(cls, "forward", None)
        for _ in range(16):
            if forward is None:
                break
            todo.append((forward, entry))
            forward = getattr(forward, "__wrapped__", None)
    for key, value in functions.items():
        todo.append((torch_body(value), key if key in recorded else None))
    seen: set[tuple[int, Any]] = set()
    while todo:
        fn, entry = todo.pop()
        fn = _function(fn)
        if not isinstance(fn, types.FunctionType) or (id(fn), entry) in seen:
            continue
        seen.add((id(fn), entry))
        namespace = fn.__globals__
        for name in _names(fn.__code__):
            value = namespace.get(name)
            body = torch_body(value) if callable(value) else None
            if not isinstance(body, types.FunctionType) or _library(body):
                continue
            key = (str(namespace.get("__name__")), name)
            if key not in functions and (reach.get(key) is None):
                reach[key] = entry
            todo.append((body, key if key in recorded else entry))
    return reach


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _library(fn: Any) -> bool:
    module = str(getattr(fn, "__module__", "") or "")
    return not module or (module.split(".")[0] in _LIBRARY and not module.startswith("transformers.models."))


def _process_changes(original: nn.Module, process: list[ProcessChange], functions: dict[tuple[str, str], Any],
                     recorded: set[Any]) -> list[Change]:
    found: list[Change] = []
    used_classes = {f"{k.__module__}.{k.__qualname__}" for m in original.modules() for k in type(m).__mro__}
    own_modules = {type(m).__module__ for m in original.modules()}
    reach = reachable_functions(original, functions, recorded) if process else {}
    for change in process:
        key = (change.owner, change.name)
        if change.kind == "function" and key in functions:
            found.append(Change(change.where, "function", "function rebound", describe_object(change.after),
                                "function" if key in recorded else "model"))
        elif change.kind == "function" and key in reach:
            via = reach[key]
            shown = via if isinstance(via, str) else (".".join(via) if via else None)
            found.append(Change(change.where, "function", "function rebound (reached through globals)",
                                describe_object(change.after) + (f", called through {shown}" if shown is not None else ""),
                                "through" if via is not None else "model", via))
        elif change.kind == "class attribute" and change.owner in used_classes:
            continue  # reported with each module of that class above
        elif change.kind == "setting":  # grad mode, a mode left entered: every model runs under it
            found.append(Change(change.where, "-", "process setting changed", change.describe(), "model"))
        elif change.kind == "function" and isinstance(change.before, types.ModuleType):  # sdpa's ``torch`` proxied
            found.append(Change(change.where, "-", "module rebound", change.describe(), "model"))
        elif change.kind == "registry entry":  # looked up by key at run time (an attention implementation)
            found.append(Change(change.where, "-", "registry entry", change.describe(), "registry", change))
        elif _elsewhere(change, own_modules):
            found.append(Change(change.where, "-", "process-wide", change.describe() + _reach(change), "none"))
        else:  # a library function the model's code may reach (Liger's cross_entropy: the loss calls it)
            found.append(Change(change.where, "-", "library function rebound", change.describe(), "model"))
    return found


def _elsewhere(change: ProcessChange, own_modules: set[str]) -> bool:
    """Whether a process-wide change cannot reach this model: a class name (read when a model is built), or a
    name in a modeling module none of this model's classes comes from (another family's), or one of this
    model's own modules that no forward reaches (found above otherwise)."""
    if isinstance(change.before, type) or isinstance(change.after, type):
        return True
    module = change.owner if change.kind == "function" else change.owner.rsplit(".", 1)[0]
    return module.startswith("transformers.models.") and module not in own_modules or module in own_modules


def _reach(change: ProcessChange) -> str:
    """Why a process-wide change does not reach this model (it is still reported, and undone after the audit)."""
    if isinstance(change.before, type) or isinstance(change.after, type):
        return " (a class name: models built after the patch get it, this one does not)"
    return " (no forward of this model reaches it, directly or through another function's globals)"
