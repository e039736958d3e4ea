"""Who patches: a callable, ``MODULE:FUNCTION``, or a named stack calling its own patching as its users do.

An :class:`Adapter` is what the audit needs of a patch: ``apply(model)`` (in place, like Liger's
``model=`` form), the environment its kernels need while the patched model runs (Triton's
interpreter for a Triton kernel on a CPU, the emulated ``torch_npu`` for an NPU kernel), and a
line per environment for the report. Named stacks (:data:`STACKS`) are one module each, imported
only when named; each builds an adapter for a model type (``for_model_type``) and lists the
model types it claims (``claims``). What a stack maps where it is not importable is data
(``engine/_data/audit_stacks.yaml``), the mechanism is code.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from engine.errors import InvalidArgument

__all__ = ["STACKS", "Adapter", "NotClaimed", "claims", "resolve"]

#: Named stacks: ``--with NAME`` -> the module implementing it (``for_model_type``, ``claims``).
STACKS: dict[str, str] = {
    "liger": "engine.auditing.adapters.liger",
    "twinkle": "engine.auditing.adapters.twinkle",
    "llamafactory-v1": "engine.auditing.adapters.llamafactory",
    "hf-kernels": "engine.auditing.adapters.hf_kernels",
    "patchset": "engine.auditing.adapters.patchset",
}


class NotClaimed(InvalidArgument):
    """A named stack has no patch for this model type (its own list does not name it)."""


@dataclass
class Adapter:
    """A patch as the audit runs it."""

    name: str
    apply: Callable[[nn.Module], Any]
    environment: Callable[[nn.Module], contextlib.AbstractContextManager[Any]] = field(
        default=lambda model: contextlib.nullcontext())
    notes: list[str] = field(default_factory=list)
    #: What to call for a function the patch bound in a modeling module (default: what is bound there).
    function: Callable[[nn.Module, Any], Any] = field(default=lambda model, value: value)
    #: What its kernels run on here where not natively ("Triton's interpreter", "the torch_npu emulator"):
    #: findings resting on that reading are labelled apart from exact-arithmetic ones.
    reading: str = ""


def claims(stack: str) -> list[str]:
    """The model types a named stack claims, by its own list."""
    return list(_stack(stack).claims())


def resolve(spec: str | Callable[[nn.Module], Any] | Adapter, model_type: str) -> Adapter:
    """``spec`` as an adapter: an :class:`Adapter`, a callable, ``MODULE:FUNCTION``, ``FILE.py:FUNCTION``,
    ``patchset:NAME`` or a stack's name (:data:`STACKS`)."""
    if isinstance(spec, Adapter):
        return spec
    if callable(spec):
        return _own(_name_of(spec), spec)
    if not isinstance(spec, str) or not spec:
        raise InvalidArgument(f"audit: a patch is a callable, MODULE:FUNCTION or one of {', '.join(STACKS)}; got {spec!r}")
    if spec.startswith("patchset:"):
        return _stack("patchset").for_model_type(model_type, spec.split(":", 1)[1])
    if spec in STACKS:
        return _stack(spec).for_model_type(model_type)
    if ":" in spec:
        return _own(spec, _function(spec))
    raise InvalidArgument(f"--with {spec}: not a stack ({', '.join(s for s in STACKS if s != 'patchset')}), "
                          "patchset:NAME, nor MODULE:FUNCTION")


def _own(name: str, fn: Callable[[nn.Module], Any]) -> Adapter:
    """A user's own patch: Triton's interpreter on where the model is on a CPU, as for the named stacks (a patch
    calling Liger's ops is judged, not "0 active drivers"); harmless to one that calls no Triton."""
    from engine.auditing.adapters.liger import triton_on_cpu

    return Adapter(name, fn, environment=triton_on_cpu)


def _stack(name: str) -> Any:
    if name not in STACKS:
        raise InvalidArgument(f"no stack {name!r}; stacks: {', '.join(STACKS)}")
    return importlib.import_module(STACKS[name])


def _name_of(fn: Any) -> str:
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return f"{module}:{name}" if module and name else repr(fn)


def _function(spec: str) -> Callable[[nn.Module], Any]:
    """``package.module:function`` (imported) or ``path/to/file.py:function`` (loaded from the file)."""
    where, _, attr = spec.rpartition(":")
    if where.endswith(".py"):
        path = Path(where)
        if not path.is_file():
            raise InvalidArgument(f"--with {spec}: no file {where}")
        name = f"_audited_{path.stem}"
        loader_spec = importlib.util.spec_from_file_location(name, path)
        assert loader_spec is not None and loader_spec.loader is not None
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module
        loader_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise InvalidArgument(f"--with {spec}: cannot import {where}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise InvalidArgument(f"--with {spec}: {where} has no function {attr!r}")
    return fn
