"""YAML with line numbers: plain data only, bounded, and the line of every key and list item.

A file is read as bytes, decoded as UTF-8, composed into YAML nodes (never constructed into
Python objects by tag: only plain data is accepted) and built into plain Python values while
a table records where each key and list item is written. Depth, size and alias expansion are
bounded while composing, so a hostile file cannot exhaust memory or the stack.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.resolver import Resolver

from engine.errors import PatchsetError
from engine.loader.messages import Origin, Path_, combine, describe, key_text, kind_of

#: Deepest nesting of mappings and lists a patchset may have.
MAX_DEPTH = 50


#: Most YAML nodes a patchset file may hold (a patch is about ten; a 4 MB file holds fewer).
MAX_NODES = 1_000_000


#: Most nodes aliases may add once expanded, beyond the file's own: refuses alias bombs (billions
#: of nodes from a few lines) after a fraction of a second, whatever the size of the file.
MAX_ALIAS_NODES = 100_000


#: Largest patchset file, in bytes.
MAX_BYTES = 4 * 1024 * 1024


_TAG = "tag:yaml.org,2002:"


_SCALAR_TAGS = {_TAG + t for t in ("null", "bool", "int", "float", "str", "timestamp")}


_AS_STRING_TAGS = {_TAG + "value", _TAG + "merge"}  # `=` and `<<` written as values: plain text


_STR_TAG = _TAG + "str"


_SEQ_TAG = _TAG + "seq"


_MAP_TAG = _TAG + "map"


_MERGE_TAG = _TAG + "merge"


def _show_tag(tag: str) -> str:
    return "!!" + tag[len(_TAG) :] if tag.startswith(_TAG) else tag


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


try:  # libyaml's event parser: the scanning, which is most of the time, runs in C
    from yaml.cyaml import CParser as _EventParser
except ImportError:  # PyYAML built without libyaml: the same events, in Python
    from yaml.parser import Parser as _PyParser
    from yaml.reader import Reader
    from yaml.scanner import Scanner

    class _EventParser(Reader, Scanner, _PyParser):  # type: ignore[no-redef]
        def __init__(self, text: str):
            Reader.__init__(self, text)
            Scanner.__init__(self)
            _PyParser.__init__(self)


class _Loader(Composer, _EventParser, SafeConstructor, Resolver):
    """Composes nodes from parser events (in C when libyaml is there), refusing deep nesting and
    huge documents while it composes; the composing itself is PyYAML's Python composer, so the
    nodes, tags and line marks are the same with and without libyaml."""

    def __init__(self, text: str, file: str | None):
        _EventParser.__init__(self, text)
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)
        self._file = file
        self._depth = 0
        self.nodes_composed = 0

    def compose_node(self, parent, index):
        self._depth += 1
        self.nodes_composed += 1
        try:
            if self._depth > MAX_DEPTH or self.nodes_composed > MAX_NODES:
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
        self.max_visits = loader.nodes_composed + MAX_ALIAS_NODES

    def fatal(self, problem: str, node: yaml.Node | None, path: Path_ = ()) -> PatchsetError:
        return PatchsetError(problem, file=self.file, line=_line(node) if node else None, key=key_text(path))

    def build(self, node: yaml.Node, path: Path_, depth: int) -> Any:
        self.visits += 1
        if self.visits > self.max_visits:
            problem = f"more than {self.max_visits} YAML nodes once aliases are expanded (an alias bomb?)"
            raise self.fatal(problem, node)
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
        if node.tag == _STR_TAG or node.tag in _AS_STRING_TAGS:  # most scalars: no constructor needed
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
            problem = f"key {node.value!r} is read as {describe(value)}, not a string{hint}; quote it"
        elif isinstance(node, yaml.ScalarNode):
            self.bad_tag(node, path)
            return None
        else:
            problem = "keys must be plain strings, not lists or mappings"
        self.errors.append(self.fatal(problem, node, path))
        return None


def read_text(path: Path, display: str) -> str:
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


def parse_yaml(text: str, file: str | None) -> tuple[dict, dict[Path_, Origin]]:
    """YAML text -> (top-level mapping, origins: data path -> (file, line))."""
    loader = None
    try:
        try:
            loader = _Loader(text, file)
            node = loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            if "maximum nesting depth" in str(exc.problem):  # libyaml's own bound (1000), below ours in effect
                line = mark.line + 1 if mark else None
                raise PatchsetError(f"nested more than {MAX_DEPTH} levels deep", file=file, line=line) from None
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
        raise combine(builder.errors, [file])
    if not isinstance(data, dict):
        # Only the kind of value, never the value: a file that is not a patchset (a config, a
        # password file behind a symlink) must not have its first line echoed into logs.
        raise PatchsetError(
            "the top level must be a mapping (name: ..., model_types: [...], patches: [...]), "
            f"not {kind_of(data)}",
            file=file,
            line=_line(node),
        )
    origins: dict[Path_, Origin] = {(): (file, _line(node))}
    origins.update({p: (file, line) for p, line in builder.lines.items()})
    return data, origins
