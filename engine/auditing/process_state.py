"""What a patch changes in the process: names rebound in modules, attributes of classes replaced.

Why: the stacks an audit judges do not patch one model. Liger rebinds ``apply_rotary_pos_emb``
and the norm class of a transformers modeling module, twinkle sets ``forward`` on the classes
of its map, LlamaFactory v1 rebinds the rope function of the modeling module it finds; every
model of the family in the process computes something else from then on. To judge such a
patch and leave the process as it found it, the audit takes a :class:`ProcessState` before the
patch, lists what differs after it (:meth:`ProcessState.changes`) and puts it back
(:meth:`ProcessState.restore`).

What is watched: every module (not package) of ``transformers``, ``torch.nn.functional`` and
``torch.nn.modules``, ``torch``'s own namespace and ``torch.Tensor``'s class (``torch.rsqrt`` or
``torch.Tensor.pow`` rebound by a patch would otherwise stay rebound after the audit), ``torch.optim.optimizer``
(its global step hooks), and the module of every class the model is built from (remote code, a user's own); of
each, its namespace and the ``__dict__`` of each class it defines. A module a name held is watched too: transformers'
sdpa module's ``torch`` swapped for a proxy reaches every sdpa model in the process. And torch's process-wide
settings and mode stacks (:mod:`engine.auditing.settings`). A watched module first imported *while the patch
runs* (twinkle imports every family of its map) is recorded the moment its import finishes, before
the patch can change it (:class:`_ImportWatcher`), so it is restored too.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import types
from collections.abc import Iterable, Iterator, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from engine.auditing.settings import Setting, settings
from engine.auditing.settings import same as same_setting

__all__ = ["ProcessChange", "ProcessState", "describe_object", "put_back", "watched_names"]

#: Prefixes of the module names watched in every process (the model's own modules are added).
WATCHED = ("transformers.", "torch.nn.functional", "torch.nn.modules.", "torch.optim.optimizer")
#: torch's own namespaces a model's code calls into (``torch.rsqrt``, ``torch.Tensor.pow``): watched for names
#: *rebound* only. torch fills these in lazily as it runs; a name it adds is not a patch and is left alone.
LIBRARY_NAMESPACES = frozenset({"torch", "torch._tensor"})

_MISSING = object()


def _watched(name: str, extra: frozenset[str]) -> bool:
    return name in extra or name.startswith(WATCHED) or name == "torch.nn.functional" or name in LIBRARY_NAMESPACES


def watched_names(extra: Iterable[str] = ()) -> list[str]:
    """The loaded modules a snapshot records: transformers' and torch.nn's modules, torch's own namespace and
    ``torch.Tensor``'s module, and ``extra``."""
    wanted = frozenset(extra)
    return sorted(n for n, m in list(sys.modules.items())
                  if isinstance(m, types.ModuleType) and _watched(n, wanted)
                  and ("__path__" not in vars(m) or n in LIBRARY_NAMESPACES))


@dataclass(frozen=True)
class ProcessChange:
    """One name a patch rebound: ``owner.name`` (a module's or a class's), from ``before`` to ``after``."""

    owner: str          # "transformers.models.olmo2.modeling_olmo2" or "...modeling_olmo2.Olmo2MLP"
    name: str
    kind: str           # "function" (a module-level name), "class attribute", "registry entry" (a key of a dict)
    #                     or "setting" (a process-wide torch setting: :mod:`engine.auditing.settings`)
    before: Any
    after: Any
    holder: Any = field(default=None, repr=False, compare=False)  # the module, class or dict to put ``before`` back in
    key: Any = field(default=None, repr=False, compare=False)     # the name, or the dict's key

    @property
    def where(self) -> str:
        if self.kind == "setting":
            return self.owner
        return f"{self.owner}[{self.name}]" if self.kind == "registry entry" else f"{self.owner}.{self.name}"

    def describe(self) -> str:
        if self.kind == "setting":
            return f"{self.owner} {_shown(self.before)} -> {_shown(self.after)}"
        if self.after is _MISSING:
            return f"{self.where} deleted"
        if self.before is _MISSING:
            return f"{self.where} added: {describe_object(self.after)}"
        return f"{self.where} rebound to {describe_object(self.after)}"


def _shown(value: Any) -> str:
    if isinstance(value, tuple) and all(not isinstance(v, (bool, int, float, str)) for v in value):
        return "[" + ", ".join(describe_object(v) for v in value) + "]"  # a stack of modes
    return repr(value)


def describe_object(value: Any) -> str:
    """``package.module.Name`` of a function, method or class; of any other callable, its class's (``a ...``)."""
    value = getattr(value, "__func__", value)
    if not isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        kind = type(value)
        return f"a {kind.__module__}.{kind.__qualname__}"
    return f"{value.__module__}.{value.__qualname__}"


def _classes(module: types.ModuleType) -> Iterator[tuple[str, type]]:
    """The classes ``module`` defines (not those it imports)."""
    for name, value in list(vars(module).items()):
        if isinstance(value, type) and value.__module__ == module.__name__:
            yield name, value


class _Record:
    """One module's namespace, its classes' ``__dict__`` and its registries, as shallow copies (identities)."""

    def __init__(self, module: types.ModuleType):
        self.module = module
        self.names = dict(vars(module))
        self.classes = {cls: dict(vars(cls)) for _, cls in _classes(module)}
        self.registries = {label: (table, dict(dict.items(table))) for label, table in _registries(module)}

    def without(self, seen: set[int]) -> _Record:
        """Drop the registries another module's record already holds (``ALL_ATTENTION_FUNCTIONS`` is imported by
        every modeling module: one table, recorded once)."""
        self.registries = {k: v for k, v in self.registries.items() if id(v[0]) not in seen}
        seen.update(id(t) for t, _ in self.registries.values())
        return self


def _registries(module: types.ModuleType) -> Iterator[tuple[str, dict[Any, Any]]]:
    """The dicts a patch may write a function into: module-level dicts, a class's dict attributes, and the
    dicts inside a module-level mapping object (transformers' ``ALL_ATTENTION_FUNCTIONS`` keeps its entries so).

    Why: twinkle's NPU attention is installed as ``ALL_ATTENTION_FUNCTIONS["sdpa"] = ...``: no name is
    rebound, one entry of a registry is.
    """
    for name, value in list(vars(module).items()):
        if isinstance(value, dict) and not isinstance(value, type):  # dict subclasses too: ACT2FN, ACT2CLS
            yield name, value
        elif isinstance(value, MutableMapping) and isinstance(inner := getattr(value, "__dict__", None), dict):
            yield from ((f"{name}.{k}", v) for k, v in inner.items() if type(v) is dict)
    for _, cls in _classes(module):
        for key, value in list(vars(cls).items()):
            if type(value) is dict and not key.startswith("__"):
                yield f"{cls.__qualname__}.{key}", value


class ProcessState:
    """A snapshot of the watched modules (see the module docstring); diff and restore."""

    def __init__(self, extra_modules: Iterable[str] = ()):
        self.extra = frozenset(extra_modules)
        self.records: dict[str, _Record] = {}
        self.tables: set[int] = set()
        for name in watched_names(self.extra):
            self.records[name] = _Record(sys.modules[name]).without(self.tables)
        self.settings = [(setting, setting.get()) for setting in settings()]

    @contextlib.contextmanager
    def watching_imports(self) -> Iterator[None]:
        """Record each watched module first imported inside the block as its import finishes."""
        watcher = _ImportWatcher(self)
        sys.meta_path.insert(0, watcher)
        try:
            yield
        finally:
            with contextlib.suppress(ValueError):
                sys.meta_path.remove(watcher)

    def changes(self) -> list[ProcessChange]:
        """Every watched name whose object is not the one recorded (by identity)."""
        found: list[ProcessChange] = []
        for name, record in self.records.items():
            now = vars(record.module)
            rebound_only = name in LIBRARY_NAMESPACES
            for key in sorted(record.names.keys() | now.keys()):
                before, after = record.names.get(key, _MISSING), now.get(key, _MISSING)
                if rebound_only and (before is _MISSING or after is _MISSING):
                    continue
                if before is not after and _patched(before, after):
                    found.append(ProcessChange(name, key, "function", before, after, record.module, key))
            for cls, attrs in record.classes.items():
                current = vars(cls)
                for key in sorted(attrs.keys() | current.keys()):
                    if key in _CLASS_CACHE:
                        continue
                    before, after = attrs.get(key, _MISSING), current.get(key, _MISSING)
                    if rebound_only and before is _MISSING and not callable(after):
                        continue
                    if before is not after and _patched(before, after):
                        found.append(ProcessChange(f"{name}.{cls.__qualname__}", key, "class attribute", before, after,
                                                   cls, key))
            for label, (table, saved) in record.registries.items():
                for key in list(saved.keys() | dict.keys(table)):  # dict's own: ACT2FN's __getitem__ builds a module
                    before, after = saved.get(key, _MISSING), dict.get(table, key, _MISSING)
                    if before is not after and _patched(before, after):
                        found.append(ProcessChange(f"{name}.{label}", repr(key), "registry entry", before, after,
                                                   table, key))
        for setting, before in self.settings:
            after = setting.get()
            if not same_setting(before, after):
                found.append(ProcessChange(setting.name, "", "setting", before, after, setting))
        return found

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """The process as it was before the patch for the block, the patch's names put back in place after it.

        Why: the original module's backward is measured while judging, and a process-wide patch (a
        class's forward, a modeling module's function) would otherwise run inside the original.
        """
        undone = self.restore()
        try:
            yield
        finally:
            for change in undone:
                put_back(change, change.after)

    def restore(self) -> list[ProcessChange]:
        """Put back every changed name (added ones deleted); returns what was put back."""
        undone = self.changes()
        for change in undone:
            put_back(change, change.before)
        return undone


#: Class attributes Python or torch fill in by themselves (not a patch's doing).
_CLASS_CACHE = frozenset({"__abstractmethods__", "_abc_impl", "__weakref__", "__dict__", "__doc__",
                          "__parameters__", "_is_protocol"})


def _patched(before: Any, after: Any) -> bool:
    """Whether a change of one name is a patch's: a function or class put there, replaced or removed.

    Why not every change: a library caches data in its globals as it runs (a dict of kwargs classes, a
    flag), and an import sets a submodule on its package; neither is a patch, and neither is undone.
    """
    def code(value: Any) -> bool:
        if isinstance(value, tuple) and value:  # ACT2FN's (class, kwargs) entries
            value = value[0]
        return value is not _MISSING and callable(value) and not isinstance(value, types.ModuleType)

    # a module a name held, rebound (transformers' sdpa module's ``torch`` swapped for a proxy that scales
    # ``scaled_dot_product_attention``): a patch. A submodule an import adds to its package is not.
    return code(before) or code(after) or (isinstance(before, types.ModuleType) and after is not _MISSING)


def put_back(change: ProcessChange, value: Any) -> None:
    """Set ``change``'s name (or registry key) to ``value``: its ``before`` to undo it, its ``after`` to redo it."""
    if isinstance(change.holder, Setting):
        change.holder.set(value)
    elif isinstance(change.holder, dict):
        _put(change.holder, change.key, value)
    else:
        _put_attr(change.holder, change.key, value)


def _put(table: dict[Any, Any], key: Any, value: Any) -> None:
    if value is _MISSING:
        table.pop(key, None)
    else:
        table[key] = value


def _put_attr(target: Any, name: str, value: Any) -> None:
    if value is _MISSING:
        if name in vars(target):
            delattr(target, name)
    else:
        setattr(target, name, value)



class _ImportWatcher(importlib.abc.MetaPathFinder):
    """A finder ahead of the others: a watched module's loader is wrapped to record the module once executed."""

    def __init__(self, state: ProcessState):
        self.state = state

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not _watched(fullname, self.state.extra) or fullname in self.state.records:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module") and not spec.submodule_search_locations:
                    spec.loader = _RecordingLoader(spec.loader, self.state)
                return spec
        return None


class _RecordingLoader(importlib.abc.Loader):
    """Runs the real loader, records the fresh module, then puts the real loader back on it."""

    def __init__(self, loader: Any, state: ProcessState):
        self.loader, self.state = loader, state

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self.loader.exec_module(module)
        module.__loader__ = self.loader
        if module.__spec__ is not None:
            module.__spec__.loader = self.loader
        if module.__name__ not in self.state.records:
            self.state.records[module.__name__] = _Record(module).without(self.state.tables)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)
