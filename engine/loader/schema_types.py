"""Following the schema's types along a pydantic error location, so a message can list the valid keys and values."""

from __future__ import annotations

import types
import typing
from enum import Enum
from typing import Any, Union

from pydantic import BaseModel

from engine.schema import Patch, Patchset


def _strip(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def literal_values(tp: Any) -> list[Any]:
    tp = _strip(tp)
    if typing.get_origin(tp) is typing.Literal:
        return [a.value if isinstance(a, Enum) else a for a in typing.get_args(tp)]
    return []


def _union_members(tp: Any) -> list[Any]:
    tp = _strip(tp)
    return [_strip(a) for a in typing.get_args(tp)] if _is_union(tp) else [tp]


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _type_at(loc: tuple) -> Any:
    """The schema type at a pydantic error location, or None when it cannot be followed."""
    tp: Any = Patchset
    for element in loc:
        tp = _strip(tp)
        members = _union_members(tp)
        models = [m for m in members if _is_model(m)]
        if len(members) > 1 and isinstance(element, str):
            # a discriminated union's tag, e.g. 'rms_norm'
            tagged = [
                m for m in models if any(element in literal_values(f.annotation) for f in m.model_fields.values())
            ]
            if len(tagged) == 1:
                tp = tagged[0]
                continue
        if len(models) == 1 and len([m for m in members if m is not type(None)]) == 1:
            tp = models[0]
        if _is_model(tp):
            if isinstance(element, str) and element in tp.model_fields:
                tp = tp.model_fields[element].annotation
                continue
            return None
        if typing.get_origin(tp) in (list, tuple, set, frozenset) and isinstance(element, int):
            tp = typing.get_args(tp)[0]
            continue
        return None
    return tp


def model_at(loc: tuple) -> type[BaseModel] | None:
    tp = _type_at(loc)
    if tp is None:
        return None
    models = [m for m in _union_members(tp) if _is_model(m)]
    return models[0] if len(models) == 1 else None


def union_tags(loc: tuple, discriminator: str) -> list[str]:
    tp = _type_at(loc)
    tags: list[str] = []
    for member in _union_members(tp) if tp is not None else []:
        if _is_model(member) and discriminator in member.model_fields:
            tags.extend(str(v) for v in literal_values(member.model_fields[discriminator].annotation))
    return tags


def patch_members() -> list[type[BaseModel]]:
    return [m for m in _union_members(Patch) if _is_model(m)]
