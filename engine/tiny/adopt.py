"""A tiny model made to run the user's own classes at every place the user's model has them.

Why: a tiny model built from transformers' classes of the user's ``model_type`` stands for the
stock code, not for what the user runs. A Qwen3 whose norms are the user's own ``Qwen3RMSNorm``
(defined in ``__main__``, computing ``(1 + w) * x``), or a subclass of transformers' model with
its own ``forward``, was verified on transformers' classes and passed, and then patched wrong
(logits off 7.4). So every verification on a tiny model first gives each of its modules the
class the user's model has at the same path, where the two hold the same parameters, buffers
and children (a class of the same layout: ``module.__class__`` can change safely), and copies
the plain attributes only the user's instance has (an ``eps`` its ``__init__`` set).

Where a class cannot be adopted (another layout: peft's LoRA layers, a fused block), it is left
out and named; :func:`adopt_classes` refuses only where a path the caller needs (the modules a
plan patches) cannot hold the user's class, since a verification there would vouch for code the
user does not run.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable

from torch import nn

from engine.errors import InvalidArgument
from engine.foundation.code_identity import own_class

__all__ = ["adopt_classes"]

_SIMPLE = (int, float, bool, str, type(None))
_INDEX = re.compile(r"\.\d+(?=\.|$)")


def _layout(module: nn.Module) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    return (tuple(sorted(module._parameters)), tuple(sorted(module._buffers)), tuple(sorted(module._modules)))


def _pattern(path: str) -> str:
    return _INDEX.sub(".*", path)


def _transformers_own(cls: type) -> bool:
    """Whether ``cls`` is the class transformers' module defines under its name (any tiny model of it runs it)."""
    module = sys.modules.get(cls.__module__)
    return cls.__module__.startswith("transformers.") and getattr(module, cls.__name__, None) is cls


def _suffixes(path: str) -> list[str]:
    parts = path.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))]


def _counterparts(model: nn.Module) -> tuple[dict[str, nn.Module], dict[str, nn.Module]]:
    """The user's modules by path, and by every pattern suffix of their path (first found wins)."""
    by_path = dict(model.named_modules())
    by_suffix: dict[str, nn.Module] = {}
    for path, module in by_path.items():
        for suffix in _suffixes(_pattern(path)) if path else [""]:
            by_suffix.setdefault(suffix, module)
    return by_path, by_suffix


def adopt_classes(tiny: nn.Module, model: nn.Module, *, required: Iterable[str] = ()) -> list[str]:
    """Give each module of ``tiny`` the class ``model`` has at its place; the paths whose class changed.

    A module's place is its path, else the longest suffix of its path's pattern
    (``model.layers.*.mlp``, ``layers.*.mlp``, ...) the user's model has: the tiny model of a type
    may be its causal-LM class where the user holds the base model. ``required``: paths of
    ``model`` (the modules a plan patches) whose class the tiny model must hold somewhere after
    adoption; one held nowhere raises :class:`InvalidArgument` naming it and why it could not be
    adopted, and the caller reports that no tiny model can verify it.
    """
    by_path, by_suffix = _counterparts(model)
    changed: list[str] = []
    refused: dict[type, str] = {}
    for path, module in tiny.named_modules():
        user = by_path.get(path)
        if user is None:
            suffixes = _suffixes(_pattern(path)) if path else [""]
            user = next((by_suffix[s] for s in suffixes if s in by_suffix), None)
        if user is None or own_class(type(user)) is type(module):  # FSDP2's FSDP<Name> wraps the same class
            continue
        if _layout(user) != _layout(module):
            refused.setdefault(type(user), f"{type(user).__qualname__} holds {_layout(user)} where the tiny model's "
                                           f"{type(module).__qualname__} at {path or '<root>'} holds {_layout(module)}")
            continue
        module.__class__ = own_class(type(user))
        for name, value in vars(user).items():  # what only the user's __init__ set (an eps under another name)
            if name not in vars(module) and isinstance(value, _SIMPLE):
                setattr(module, name, value)
        changed.append(path)
    held = {type(module) for module in tiny.modules()}
    # transformers' own class missing from the tiny model (another config: a dense layer where it has only sparse
    # ones) is the verifier's "did not run in the tiny model" finding; a class of the user's held nowhere is this one
    missing = [(path, own_class(type(by_path[path]))) for path in required if path in by_path]
    missing = [(path, cls) for path, cls in missing if cls not in held and not _transformers_own(cls)]
    if missing:
        path, cls = missing[0]
        why = f": {refused[cls]}" if cls in refused else ": the tiny model has no module at its place"
        raise InvalidArgument(f"no tiny model can run your {cls.__module__}.{cls.__qualname__} (at {path}){why}; a "
                              "verification on a tiny model would vouch for code this model does not run")
    return changed
