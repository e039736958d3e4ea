"""Loading patchsets: files, line numbers, ``extends`` and name resolution.

A patchset is read as bytes, decoded as UTF-8, composed into YAML nodes (never constructed
into Python objects by tag: only plain data is accepted) and built into plain Python values
while a table records the line of every key and list item. That table survives ``extends``
merges, so each problem is reported where it is written, as ``file:line: key: problem``::

    patchsets/x.yaml:12: patches[1].scale: 'one_plus_weigth' is not one of 'weight', 'one_plus_weight'

Every problem of a file is reported at once: the raised :class:`PatchsetError` carries the
first problem's ``file``, ``line`` and ``key``, its ``errors`` attribute lists one
:class:`PatchsetError` per problem, and its text has one line per problem.

Names resolve to the bundled ``patchsets/`` folder first, then to paths.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import re
import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import BaseModel, ValidationError

from engine.errors import PatchsetError
from engine.schema import Patch, Patchset

__all__ = [
    "MAX_BYTES",
    "MAX_DEPTH",
    "MAX_EXTENDS",
    "MAX_NODES",
    "bundled_dir",
    "bundled_names",
    "json_schema",
    "json_schema_text",
    "load_patchset",
    "patch_location",
    "resolve",
    "write_json_schema",
]

#: Deepest nesting of mappings and lists a patchset may have.
MAX_DEPTH = 50
#: Most YAML nodes a patchset may have, counting every expansion of an alias (refuses alias bombs).
MAX_NODES = 100_000
#: Largest patchset file, in bytes.
MAX_BYTES = 4 * 1024 * 1024
#: Longest ``extends`` chain.
MAX_EXTENDS = 32

#: Where the schema is generated, relative to the repository root.
SCHEMA_FILE = "schemas/patchset.schema.json"

_YAML_EXT = (".yaml", ".yml")

Path_ = tuple  # a data path such as ("patches", 1, "scale")
_Origin = tuple  # (file or None, 1-based line)


# --------------------------------------------------------------------------------------
# Names and paths


def bundled_dir() -> Path:
    """The folder of the bundled patchsets.

    ``engine/_bundled/patchsets`` when it exists (a wheel install), else ``patchsets/`` next to
    the ``engine`` package (a source checkout or an editable install).
    """
    package = Path(__file__).resolve().parent
    wheel = package / "_bundled" / "patchsets"
    if wheel.is_dir():
        return wheel
    return package.parent / "patchsets"


def bundled_names() -> list[str]:
    """Sorted names (file stems) of the bundled patchsets."""
    folder = bundled_dir()
    if not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.glob("*.yaml") if p.is_file())


def _bundled_hint() -> str:
    names = bundled_names()
    return "bundled patchsets: " + (", ".join(names) if names else "(none)")


def _bundled_file(name: str) -> Path | None:
    """The bundled file for a plain name such as ``qwen3`` or ``qwen3.yaml``, if any."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    stem = name
    for ext in _YAML_EXT:
        if stem.endswith(ext):
            stem = stem[: -len(ext)]
            break
    if not stem:
        return None
    candidate = bundled_dir() / f"{stem}.yaml"
    return candidate if candidate.is_file() else None


def resolve(name_or_path: str | os.PathLike, relative_to: Path | str | os.PathLike | None = None) -> Path:
    """Find a patchset file: a bundled name first, then relative to ``relative_to``, then as given.

    ``relative_to`` is the folder of the extending file (a file is taken to mean its folder).
    A path without a suffix also matches the same path with ``.yaml``. Raises
    :class:`PatchsetError`, listing the bundled names, when nothing is found.
    """
    raw = os.fspath(name_or_path)
    text = os.fsdecode(raw)
    bundled = _bundled_file(text)
    if bundled is not None:
        return bundled
    if not text:
        raise PatchsetError(f"empty patchset name; {_bundled_hint()}")
    given = Path(text)
    bases: list[Path] = []
    if relative_to is not None and not given.is_absolute():
        folder = Path(relative_to)
        if folder.is_file():
            folder = folder.parent
        bases.append(folder / given)
    bases.append(given)
    tried: list[str] = []
    for base in bases:
        candidates = [base]
        if base.suffix not in _YAML_EXT:
            candidates.append(base.with_name(base.name + ".yaml"))
        for candidate in candidates:
            tried.append(str(candidate))
            if candidate.is_file():
                return candidate
    looked = ", ".join(dict.fromkeys(tried))
    raise PatchsetError(
        f"no patchset {text!r}: not a bundled name and no such file (looked at {looked}); {_bundled_hint()}"
    )


# --------------------------------------------------------------------------------------
# YAML with line numbers

_TAG = "tag:yaml.org,2002:"
_SCALAR_TAGS = {_TAG + t for t in ("null", "bool", "int", "float", "str", "timestamp")}
_AS_STRING_TAGS = {_TAG + "value", _TAG + "merge"}  # `=` and `<<` written as values: plain text
_SEQ_TAG = _TAG + "seq"
_MAP_TAG = _TAG + "map"
_MERGE_TAG = _TAG + "merge"


def _show_tag(tag: str) -> str:
    return "!!" + tag[len(_TAG) :] if tag.startswith(_TAG) else tag


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


class _Loader(yaml.SafeLoader):
    """A safe loader that refuses deep nesting and huge documents while it composes."""

    def __init__(self, text: str, file: str | None):
        super().__init__(text)
        self._file = file
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent, index):
        self._depth += 1
        self._nodes += 1
        try:
            if self._depth > MAX_DEPTH or self._nodes > MAX_NODES:
                event = self.peek_event()
                line = event.start_mark.line + 1 if event.start_mark else None
                if self._depth > MAX_DEPTH:
                    problem = f"nested more than {MAX_DEPTH} levels deep"
                else:
                    problem = f"more than {MAX_NODES} YAML nodes"
                raise PatchsetError(problem, file=self._file, line=line)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


class _Builder:
    """Builds plain values from composed nodes, recording the line of every key and list item."""

    def __init__(self, loader: _Loader, file: str | None):
        self.loader = loader
        self.file = file
        self.lines: dict[Path_, int] = {}
        self.errors: list[PatchsetError] = []
        self.visits = 0

    def fatal(self, problem: str, node: yaml.Node | None, path: Path_ = ()) -> PatchsetError:
        return PatchsetError(problem, file=self.file, line=_line(node) if node else None, key=_key_text(path))

    def build(self, node: yaml.Node, path: Path_, depth: int) -> Any:
        self.visits += 1
        if self.visits > MAX_NODES:
            raise self.fatal(f"more than {MAX_NODES} YAML nodes once aliases are expanded (an alias bomb?)", node)
        if depth > MAX_DEPTH:
            raise self.fatal(f"nested more than {MAX_DEPTH} levels deep (a recursive alias?)", node)
        if isinstance(node, yaml.ScalarNode):
            return self.scalar(node, path)
        if isinstance(node, yaml.SequenceNode):
            if node.tag != _SEQ_TAG:
                return self.bad_tag(node, path)
            items = []
            for index, child in enumerate(node.value):
                self.lines[path + (index,)] = _line(child)
                items.append(self.build(child, path + (index,), depth + 1))
            return items
        if isinstance(node, yaml.MappingNode):
            if node.tag != _MAP_TAG:
                return self.bad_tag(node, path)
            return self.mapping(node, path, depth)
        raise self.fatal(f"unexpected YAML node {type(node).__name__}", node, path)  # pragma: no cover

    def bad_tag(self, node: yaml.Node, path: Path_) -> None:
        self.errors.append(
            self.fatal(
                f"YAML tag {_show_tag(node.tag)!r} is not allowed: a patchset is plain data "
                "(strings, numbers, booleans, null, lists and mappings)",
                node,
                path,
            )
        )

    def scalar(self, node: yaml.ScalarNode, path: Path_) -> Any:
        if node.tag in _AS_STRING_TAGS:
            return node.value
        if node.tag not in _SCALAR_TAGS:
            return self.bad_tag(node, path)
        try:
            return self.loader.construct_object(node, deep=True)
        except Exception as exc:  # e.g. `!!int abc`, an int of too many digits
            detail = getattr(exc, "problem", None) or str(exc)
            self.errors.append(self.fatal(f"cannot read {node.value!r} as {_show_tag(node.tag)}: {detail}", node, path))
            return None

    def mapping(self, node: yaml.MappingNode, path: Path_, depth: int) -> dict:
        own: dict[str, Any] = {}
        own_lines: dict[str, int] = {}
        merge_sources: list[yaml.Node] = []
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                if isinstance(value_node, yaml.MappingNode):
                    merge_sources.append(value_node)
                elif isinstance(value_node, yaml.SequenceNode) and all(
                    isinstance(v, yaml.MappingNode) for v in value_node.value
                ):
                    merge_sources.extend(value_node.value)
                else:
                    problem = "a merge key '<<' needs a mapping or a list of mappings"
                    self.errors.append(self.fatal(problem, key_node, path))
                continue
            key = self.key(key_node, path)
            if key is None:
                continue
            if key in own:
                self.errors.append(
                    self.fatal(f"duplicate key {key!r} (first at line {own_lines[key]})", key_node, path + (key,))
                )
                continue
            own_lines[key] = _line(key_node)
            self.lines[path + (key,)] = own_lines[key]
            own[key] = self.build(value_node, path + (key,), depth + 1)
        if not merge_sources:
            return own
        # `<<: *base` or `<<: [*a, *b]`: own keys win, then earlier sources win over later ones.
        merged: dict[str, Any] = {}
        for source in merge_sources:
            saved, self.lines = self.lines, {}
            try:
                values = self.build(source, path, depth)
                recorded = self.lines
            finally:
                self.lines = saved
            if not isinstance(values, dict):
                continue
            for key, value in values.items():
                if key in own or key in merged:
                    continue
                merged[key] = value
                for p, line in recorded.items():
                    if len(p) > len(path) and p[len(path)] == key:
                        self.lines[p] = line
        merged.update(own)
        return merged

    def key(self, node: yaml.Node, path: Path_) -> str | None:
        if isinstance(node, yaml.ScalarNode) and node.tag in _SCALAR_TAGS | _AS_STRING_TAGS:
            value = self.scalar(node, path)
            if isinstance(value, str):
                return value
            hint = " (YAML reads yes/no/on/off as booleans)" if isinstance(value, bool) else ""
            problem = f"key {node.value!r} is read as {_describe(value)}, not a string{hint}; quote it"
        elif isinstance(node, yaml.ScalarNode):
            self.bad_tag(node, path)
            return None
        else:
            problem = "keys must be plain strings, not lists or mappings"
        self.errors.append(self.fatal(problem, node, path))
        return None


def _read_text(path: Path, display: str) -> str:
    try:
        if not path.is_file():
            raise PatchsetError("no such file" if not path.exists() else "not a file", file=display)
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise PatchsetError(f"file is too large ({size} bytes; at most {MAX_BYTES})", file=display)
        data = path.read_bytes()
    except OSError as exc:
        raise PatchsetError(f"cannot read: {exc.strerror or exc}", file=display) from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        bad = data[exc.start : exc.start + 1].hex()
        problem = f"not valid UTF-8 (byte 0x{bad}); save the file as UTF-8"
        raise PatchsetError(problem, file=display, line=line) from None


def _parse_yaml(text: str, file: str | None) -> tuple[dict, dict[Path_, _Origin]]:
    """YAML text -> (top-level mapping, origins: data path -> (file, line))."""
    loader = None
    try:
        try:
            loader = _Loader(text, file)
            node = loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            parts = [p for p in (exc.context, exc.problem) if p]
            problem = "YAML syntax error: " + (", ".join(parts) if parts else "invalid YAML")
            raise PatchsetError(problem, file=file, line=mark.line + 1 if mark else None) from None
        except yaml.reader.ReaderError as exc:
            line = text[: exc.position].count("\n") + 1 if isinstance(exc.position, int) else None
            char = chr(exc.character) if isinstance(exc.character, int) else exc.character
            problem = f"YAML syntax error: character {char!r} is not allowed in YAML"
            raise PatchsetError(problem, file=file, line=line) from None
        except yaml.YAMLError as exc:
            raise PatchsetError(f"YAML syntax error: {exc}", file=file) from None
        except RecursionError:
            raise PatchsetError(f"nested more than {MAX_DEPTH} levels deep", file=file) from None
        if node is None:
            raise PatchsetError(
                "the file is empty; a patchset is a mapping with at least 'name', 'model_types' and 'patches'",
                file=file,
                line=1,
            )
        builder = _Builder(loader, file)
        try:
            data = builder.build(node, (), 0)
        except RecursionError:
            raise PatchsetError(f"nested more than {MAX_DEPTH} levels deep", file=file) from None
    finally:
        if loader is not None:
            loader.dispose()
    if builder.errors:
        raise _combine(builder.errors, [file])
    if not isinstance(data, dict):
        raise PatchsetError(
            f"the top level must be a mapping (name: ..., model_types: [...], patches: [...]), not {_describe(data)}",
            file=file,
            line=_line(node),
        )
    origins: dict[Path_, _Origin] = {(): (file, _line(node))}
    origins.update({p: (file, line) for p, line in builder.lines.items()})
    return data, origins


# --------------------------------------------------------------------------------------
# Types of the schema, for messages


def _strip(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def _literal_values(tp: Any) -> list[Any]:
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
                m for m in models if any(element in _literal_values(f.annotation) for f in m.model_fields.values())
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


def _model_at(loc: tuple) -> type[BaseModel] | None:
    tp = _type_at(loc)
    if tp is None:
        return None
    models = [m for m in _union_members(tp) if _is_model(m)]
    return models[0] if len(models) == 1 else None


def _union_tags(loc: tuple, discriminator: str) -> list[str]:
    tp = _type_at(loc)
    tags: list[str] = []
    for member in _union_members(tp) if tp is not None else []:
        if _is_model(member) and discriminator in member.model_fields:
            tags.extend(str(v) for v in _literal_values(member.model_fields[discriminator].annotation))
    return tags


def _patch_members() -> list[type[BaseModel]]:
    return [m for m in _union_members(Patch) if _is_model(m)]


# --------------------------------------------------------------------------------------
# Messages


def _key_text(path: Path_) -> str | None:
    text = ""
    for element in path:
        if isinstance(element, int):
            text += f"[{element}]"
        elif re.fullmatch(r"[A-Za-z0-9_\-]+", element):
            text += ("." if text else "") + element
        else:
            text += f"[{element!r}]"
    return text or None


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, (int, float, str)):
        text = repr(value)
        return text if len(text) <= 60 else text[:57] + "..."
    return f"a {type(value).__name__}"


def _quoted(values: list[Any]) -> str:
    return ", ".join(repr(str(v)) for v in values)


def _did_you_mean(word: Any, choices: list[str]) -> str:
    match = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    return f"; did you mean {match[0]!r}?" if match else ""


_EXPECTED = {
    "string_type": "a string",
    "dict_type": "a mapping",
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "list_type": "a list",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
}

_WHOLE_INPUT = set(_EXPECTED) | {"literal_error", "enum"}


def _expected_values(err: dict) -> list[str]:
    return re.findall(r"'((?:[^'\\]|\\.)*)'", str((err.get("ctx") or {}).get("expected", "")))


def _expectation(err: dict) -> str:
    if err["type"] in ("literal_error", "enum"):
        return _quoted(_expected_values(err)) or err["msg"]
    return _EXPECTED.get(err["type"], err["msg"][:1].lower() + err["msg"][1:])


def _message(err: dict, data: Any, path: Path_) -> tuple[str, Path_]:
    """A friendly problem text for one pydantic error, and the data path to report it at."""
    kind, loc, ctx = err["type"], tuple(err["loc"]), err.get("ctx") or {}
    value = err.get("input")
    if kind == "extra_forbidden":
        key = loc[-1]
        model = _model_at(loc[:-1])
        fields = list(model.model_fields) if model is not None else []
        hint = _did_you_mean(key, fields)
        if not hint and fields:
            hint = "; valid keys: " + ", ".join(fields)
        return f"unknown key {key!r}{hint}", path
    if kind == "missing":
        return f"missing required key {loc[-1]!r}", path
    if kind == "union_tag_invalid":
        name = str(ctx.get("discriminator", "'op'")).strip("'\"")
        tags = re.findall(r"'([^']*)'", str(ctx.get("expected_tags", "")))
        holder = _get(data, path)
        tag = ctx.get("tag")
        if isinstance(holder, dict) and name in holder:
            tag = holder[name]
            path = path + (name,)
        return f"{name} {_describe(tag)} is not one of {_quoted(tags)}{_did_you_mean(tag, tags)}", path
    if kind == "union_tag_not_found":
        name = str(ctx.get("discriminator", "'op'")).strip("'\"")
        tags = _union_tags(loc, name)
        return f"missing required key {name!r}" + (f" (one of {_quoted(tags)})" if tags else ""), path
    if kind in ("enum", "literal_error"):
        return f"{_describe(value)} is not one of {_quoted(_expected_values(err))}", path
    if kind in ("value_error", "assertion_error"):
        error = ctx.get("error")
        text = str(error) if error is not None else err["msg"]
        return re.sub(r"^(Value error|Assertion failed), ", "", text), path
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {_describe(value)}", path
    if kind == "string_too_short":
        n = ctx.get("min_length", 1)
        return ("must not be empty" if n == 1 else f"must have at least {n} characters"), path
    if kind == "too_short":
        n = ctx.get("min_length", 1)
        return f"must have at least {n} item{'s' if n != 1 else ''}", path
    if kind == "string_pattern_mismatch":
        return f"{_describe(value)} does not match the pattern {ctx.get('pattern')}", path
    if kind == "invalid_key":
        return f"key {_describe(value)} is not a string", path
    return err["msg"], path


def _get(data: Any, path: Path_) -> Any:
    for element in path:
        data = data[element]
    return data


def _map_loc(data: Any, loc: tuple) -> Path_:
    """The data path of a pydantic loc: elements that are not keys or indices (union tags) drop out."""
    path: list[Any] = []
    current = data
    for element in loc:
        if isinstance(current, dict) and isinstance(element, str) and element in current or (
            isinstance(current, list)
            and isinstance(element, int)
            and not isinstance(element, bool)
            and 0 <= element < len(current)
        ):
            current = current[element]
            path.append(element)
    return tuple(path)


def _locate(path: Path_, origins: dict[Path_, _Origin]) -> _Origin:
    for n in range(len(path), -1, -1):
        if path[:n] in origins:
            return origins[path[:n]]
    return (None, None)


def _error_at(problem: str, path: Path_, origins: dict[Path_, _Origin]) -> PatchsetError:
    file, line = _locate(path, origins)
    return PatchsetError(problem, file=file, line=line, key=_key_text(path))


def _combine(errors: list[PatchsetError], file_order: list[str | None]) -> PatchsetError:
    """One error for many: the first's location as attributes, one line per problem as text."""
    unique: dict[tuple, PatchsetError] = {}
    for e in errors:
        unique.setdefault((e.file, e.line, e.key, e.problem), e)
    rank = {f: i for i, f in enumerate(dict.fromkeys(file_order))}
    ordered = sorted(
        unique.values(),
        key=lambda e: (rank.get(e.file, len(rank)), e.line if e.line is not None else 0),
    )
    first = ordered[0]
    combined = PatchsetError(first.problem, file=first.file, line=first.line, key=first.key)
    combined.errors = ordered
    if len(ordered) > 1:
        combined.args = ("\n".join(str(e) for e in ordered),)
    return combined


def _validation_errors(
    exc: ValidationError, data: dict, origins: dict[Path_, _Origin], have_duplicates: bool
) -> list[PatchsetError]:
    found: list[tuple[Path_, dict]] = []
    for err in exc.errors():
        if have_duplicates and err["type"] == "value_error" and not err["loc"] and "already targeted" in err["msg"]:
            continue  # reported already, at the right line
        found.append((_map_loc(data, tuple(err["loc"])), err))
    # A plain union (e.g. `kernel: auto | name | {device: name}`) fails once per member. If a
    # member got further into the value, keep its errors; else say what any member accepts.
    by_path: dict[Path_, list[dict]] = {}
    for path, err in found:
        if err["type"] in _WHOLE_INPUT:
            by_path.setdefault(path, []).append(err)
    unions = {p for p, errs in by_path.items() if len(errs) > 1}
    out: list[PatchsetError] = []
    done: set[Path_] = set()
    for path, err in found:
        if path in unions and err["type"] in _WHOLE_INPUT:
            deeper = any(len(q) > len(path) and q[: len(path)] == path for q, _ in found)
            if deeper or path in done:
                continue
            done.add(path)
            wanted = list(dict.fromkeys(_expectation(e) for e in by_path[path]))
            wants = wanted[0] if len(wanted) == 1 else ", ".join(wanted[:-1]) + " or " + wanted[-1]
            out.append(_error_at(f"expected {wants}, got {_describe(err.get('input'))}", path, origins))
            continue
        if (not err["loc"]) and err["type"] == "value_error":
            match = re.match(r"(?:Value error, )?patches\[(\d+)\]", err["msg"])
            if match:
                path = ("patches", int(match.group(1)))
        try:
            problem, where = _message(err, data, path)
        except Exception:  # a message must never hide the error itself
            problem, where = err.get("msg", "invalid value"), path
        out.append(_error_at(problem, where, origins))
    return out


# --------------------------------------------------------------------------------------
# Duplicate targets and extends


def _default_function(op: Any) -> str | None:
    for member in _patch_members():
        field = member.model_fields.get("op")
        if field is not None and op in _literal_values(field.annotation):
            function = member.model_fields.get("function")
            if function is not None and isinstance(function.default, str):
                return function.default
    return None


def _raw_patch_key(patch: Any) -> str | None:
    """``patch_key`` of a patch not yet validated: its target, or ``function:`` and its function."""
    if not isinstance(patch, dict):
        return None
    target = patch.get("target")
    if isinstance(target, str) and target:
        return target
    function = patch.get("function", _default_function(patch.get("op")))
    if isinstance(function, str) and function:
        return f"function:{function}"
    return None


def _duplicate_errors(data: dict, origins: dict[Path_, _Origin]) -> list[PatchsetError]:
    patches = data.get("patches")
    if not isinstance(patches, list):
        return []
    seen: dict[str, int] = {}
    errors = []
    for index, patch in enumerate(patches):
        key = _raw_patch_key(patch)
        if key is None:
            continue
        if key in seen:
            first = seen[key]
            first_line = _locate(("patches", first), origins)[1]
            at = f"patches[{first}]" + (f" (line {first_line})" if first_line else "")
            field = "function" if key.startswith("function:") else "target"
            name = key.split(":", 1)[1] if field == "function" else key
            path: Path_ = ("patches", index) + ((field,) if field in patch else ())
            problem = f"duplicate {field} {name!r}, already patched by {at}; merge them into one patch"
            errors.append(_error_at(problem, path, origins))
        else:
            seen[key] = index
    return errors


def _shift(origins: dict[Path_, _Origin], prefix: Path_, new_prefix: Path_) -> dict[Path_, _Origin]:
    n = len(prefix)
    return {new_prefix + p[n:]: o for p, o in origins.items() if p[:n] == prefix}


def _merge(
    base: dict, base_origins: dict[Path_, _Origin], child: dict, child_origins: dict[Path_, _Origin]
) -> tuple[dict, dict[Path_, _Origin]]:
    """The child's top-level keys override the base's; patches are the base's, then the child's,
    a child patch replacing in place the base's patch with the same target or function."""
    data: dict[str, Any] = {}
    origins: dict[Path_, _Origin] = {(): child_origins.get((), base_origins.get((), (None, None)))}
    for key in list(base) + [k for k in child if k not in base]:
        source, source_origins = (child, child_origins) if key in child else (base, base_origins)
        data[key] = source[key]
        origins.update(_shift(source_origins, (key,), (key,)))
    base_patches, child_patches = base.get("patches"), child.get("patches")
    if isinstance(base_patches, list) and isinstance(child_patches, list):
        merged: list[tuple[Any, dict, int]] = [(p, base_origins, i) for i, p in enumerate(base_patches)]
        where = {_raw_patch_key(p): i for i, (p, _, _) in enumerate(merged) if _raw_patch_key(p) is not None}
        for i, patch in enumerate(child_patches):
            key = _raw_patch_key(patch)
            if key is not None and key in where:
                merged[where[key]] = (patch, child_origins, i)
            else:
                if key is not None:
                    where[key] = len(merged)
                merged.append((patch, child_origins, i))
        data["patches"] = [p for p, _, _ in merged]
        origins = {p: o for p, o in origins.items() if p[:1] != ("patches",)}
        origins[("patches",)] = child_origins.get(("patches",), (None, None))
        for new_index, (_, source_origins, old_index) in enumerate(merged):
            origins.update(_shift(source_origins, ("patches", old_index), ("patches", new_index)))
    return data, origins


def _load_raw(
    data: dict,
    origins: dict[Path_, _Origin],
    folder: Path | None,
    chain: list[tuple[Path, str]],
    errors: list[PatchsetError],
    files: list[str | None],
) -> tuple[dict, dict[Path_, _Origin]]:
    """Check one file's raw data, then resolve and merge its ``extends`` chain."""
    errors.extend(_duplicate_errors(data, origins))
    if "extends" not in data or data["extends"] is None:
        return data, origins
    parent = data["extends"]
    if not isinstance(parent, str) or not parent:
        raise _error_at(
            f"extends must name a bundled patchset or a file, got {_describe(parent)}", ("extends",), origins
        )
    try:
        path = resolve(parent, relative_to=folder)
    except PatchsetError as exc:
        raise _error_at(exc.problem, ("extends",), origins) from None
    real = path.resolve()
    if any(real == seen for seen, _ in chain):
        names = [shown for _, shown in chain]
        start = next(i for i, (seen, _) in enumerate(chain) if seen == real)
        cycle = " -> ".join(names[start:] + [names[start]])
        raise _error_at(f"extends cycle: {cycle}", ("extends",), origins)
    if len(chain) >= MAX_EXTENDS:
        raise _error_at(f"extends chain longer than {MAX_EXTENDS} files", ("extends",), origins)
    shown = str(path)
    files.append(shown)
    base, base_origins = _parse_yaml(_read_text(path, shown), shown)
    base, base_origins = _load_raw(base, base_origins, path.parent, chain + [(real, shown)], errors, files)
    return _merge(base, base_origins, data, origins)


def _finish(
    data: dict,
    origins: dict[Path_, _Origin],
    folder: Path | None,
    chain: list[tuple[Path, str]],
    files: list[str | None],
) -> Patchset:
    errors: list[PatchsetError] = []
    data, origins = _load_raw(data, origins, folder, chain, errors, files)
    try:
        patchset = Patchset.model_validate(data)
    except ValidationError as exc:
        errors.extend(_validation_errors(exc, data, origins, have_duplicates=bool(errors)))
    if errors:
        raise _combine(errors, files)
    patchset._origins = {
        path[1:]: origin for path, origin in origins.items() if len(path) in (2, 3) and path[0] == "patches"
    }
    return patchset


def patch_location(patchset: Patchset, index: int, key: str | None = None) -> str:
    """``file:line: `` where ``patches[index]`` (or its ``key``) is written; ``""`` if not from a file.

    The planner prefixes its errors with it, so a refusal points at the offending patch.
    """
    origins = patchset._origins
    file, line = origins.get((index, key), (None, None)) if key else (None, None)
    if file is None:
        file, line = origins.get((index,), (None, None))
    if file is None:
        return ""
    return f"{file}:{line}: " if line is not None else f"{file}: "


def load_patchset(source: str | os.PathLike | dict) -> Patchset:
    """Load and validate a patchset.

    Args:
        source: a bundled name (``"qwen3"`` or ``"qwen3.yaml"``, looked up in
            :func:`bundled_dir` first), a path, or an in-memory patchset (a dict; its
            errors have ``file=None``, its ``extends`` resolves relative to the working folder).

    Raises:
        PatchsetError: every problem found, one line each, as ``file:line: key: problem``.
    """
    if isinstance(source, dict):
        data = copy.deepcopy(source)
        return _finish(data, {}, None, [], [None])
    if isinstance(source, str):
        path = resolve(source)
    elif isinstance(source, os.PathLike):
        path = Path(os.fspath(source))
    else:
        raise PatchsetError(f"a patchset source is a name, a path or a dict, not {type(source).__name__}")
    shown = str(path)
    data, origins = _parse_yaml(_read_text(path, shown), shown)
    return _finish(data, origins, path.parent, [(path.resolve(), shown)], [shown])


# --------------------------------------------------------------------------------------
# JSON Schema


def json_schema() -> dict:
    """The JSON Schema (draft 2020-12) of a patchset file, for editors and CI."""
    schema = Patchset.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "patch-engine patchset"
    return schema


def json_schema_text() -> str:
    """:func:`json_schema` as the text of ``schemas/patchset.schema.json`` (sorted keys)."""
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"


def write_json_schema(path: str | os.PathLike) -> None:
    """Write :func:`json_schema_text` to ``path``."""
    Path(path).write_text(json_schema_text(), encoding="utf-8")
