"""Property-based loader tests beyond test_loader.py's random text and byte edits.

Structured fuzzing: random YAML values in place of each key, missing keys, huge numbers,
deep nesting, anchors and aliases (including undefined and recursive ones), Python and
custom tags anywhere, and non-UTF-8 bytes anywhere. The only exception that may escape is
PatchsetError, located at the file (and a line for anything inside it); no tag ever
constructs an object or calls anything.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.errors import PatchsetError
from engine.loader import load_patchset

VALID = {
    "name": "fuzz",
    "model_types": ["qwen3"],
    "requires": {"transformers": ">=5.0,<6"},
    "patches": [
        {"target": "Qwen3RMSNorm", "op": "rms_norm", "scale": "weight", "signature": "(self, x)"},
        {"target": "Qwen3MLP", "op": "swiglu", "kernel": {"cpu": "torch"}},
        {"op": "rope"},
    ],
}

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# A sentinel module: any tag that constructs or calls something would land here.
SENTINEL = types.ModuleType("fuzz_sentinel")
SENTINEL.calls = []  # type: ignore[attr-defined]


class _Boom:
    def __init__(self, *args, **kwargs):
        SENTINEL.calls.append(("init", args, kwargs))

    def __setstate__(self, state):
        SENTINEL.calls.append(("setstate", state))


SENTINEL.Boom = _Boom  # type: ignore[attr-defined]
SENTINEL.record = lambda *a, **k: SENTINEL.calls.append(("call", a, k))  # type: ignore[attr-defined]
sys.modules["fuzz_sentinel"] = SENTINEL

TAGS = [
    "!!python/object:fuzz_sentinel.Boom",
    "!!python/object/new:fuzz_sentinel.Boom",
    "!!python/object/apply:fuzz_sentinel.record",
    "!!python/name:fuzz_sentinel.record",
    "!!python/module:fuzz_sentinel",
    "!!python/tuple",
    "!!binary",
    "!!set",
    "!!omap",
    "!custom",
    "!!str",
    "!!int",
]

scalars = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=10**30, max_value=10**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["", "weight", "rms_norm", "auto", "torch", "<<", "=", "~", "null", ".inf", "0x1F", "1e400"])
)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    st.text(max_size=6) | st.sampled_from(["op", "target", "scale", "kernel"]), inner, max_size=3), max_leaves=12)


def _paths(data, prefix=()):
    yield prefix
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _paths(v, prefix + (i,))


ALL_PATHS = [p for p in _paths(VALID) if p]


def _set(data, path, value, delete=False):
    import copy

    data = copy.deepcopy(data)
    holder = data
    for key in path[:-1]:
        holder = holder[key]
    if delete:
        del holder[path[-1]]
    else:
        holder[path[-1]] = value
    return data


def check(path: Path) -> None:
    """Load ``path``: success, or a PatchsetError that names the file (and a line, when inside it)."""
    try:
        load_patchset(path)
    except PatchsetError as err:
        assert err.file == str(path), err
        assert str(err).startswith(str(path)), err
        for each in getattr(err, "errors", None) or [err]:
            assert each.file is not None and str(each).startswith(each.file)
    assert SENTINEL.calls == [], "a YAML tag constructed or called something"


@FUZZ
@given(path=st.sampled_from(ALL_PATHS), value=values, delete=st.booleans())
def test_any_value_anywhere_or_a_missing_key(tmp_path, path, value, delete) -> None:
    file = tmp_path / "fuzz.yaml"
    file.write_text(yaml.safe_dump(_set(VALID, path, value, delete), allow_unicode=True), encoding="utf-8")
    check(file)


@FUZZ
@given(depth=st.integers(1, 200), kind=st.sampled_from(["[", "{a: ", "- "]))
def test_deep_nesting(tmp_path, depth, kind) -> None:
    if kind == "- ":
        text = "name:\n" + "".join("  " * (i + 1) + "-\n" for i in range(depth)) + "  " * (depth + 1) + "- x\n"
    else:
        close = "]" if kind == "[" else "}"
        text = "name: " + kind * depth + "x" + close * depth + "\n"
    file = tmp_path / "deep.yaml"
    file.write_text(text, encoding="utf-8")
    check(file)


@FUZZ
@given(
    anchor_at=st.sampled_from(["name", "model_types", "patches", "op", "scale"]),
    alias_at=st.sampled_from(["description", "name", "scale", "kernel", "target", "requires"]),
    undefined=st.booleans(),
    merge=st.booleans(),
)
def test_anchors_and_aliases(tmp_path, anchor_at, alias_at, undefined, merge) -> None:
    text = yaml.safe_dump(VALID, sort_keys=False)
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.lstrip("- ").startswith(f"{anchor_at}:"):
            lines[i] = line.replace(f"{anchor_at}:", f"{anchor_at}: &A", 1)
            break
    alias = "*B" if undefined else "*A"
    value = f"{{<<: {alias}}}" if merge else alias
    for i, line in enumerate(lines):
        if line.lstrip("- ").startswith(f"{alias_at}:"):
            indent = line[: len(line) - len(line.lstrip())]
            lines[i] = f"{indent}{alias_at}: {value}" if not line.lstrip().startswith("- ") else line
            break
    else:
        lines.append(f"{alias_at}: {value}")
    file = tmp_path / "alias.yaml"
    file.write_text("\n".join(lines) + "\n", encoding="utf-8")
    check(file)


@FUZZ
@given(tag=st.sampled_from(TAGS), path=st.sampled_from(ALL_PATHS), argument=st.sampled_from(["x", "[1, 2]", "{a: 1}"]))
def test_tags_never_construct_anything(tmp_path, tag, path, argument) -> None:
    text = yaml.safe_dump(_set(VALID, path, "PLACEHOLDER"), sort_keys=False)
    file = tmp_path / "tags.yaml"
    file.write_text(text.replace("PLACEHOLDER", f"{tag} {argument}"), encoding="utf-8")
    check(file)
    if tag.startswith("!!python") or tag == "!custom":
        try:
            load_patchset(file)
        except PatchsetError as err:
            assert "is not allowed" in str(err) and err.line is not None
        else:
            raise AssertionError(f"{tag} was accepted")


@FUZZ
@given(position=st.integers(0, 400), raw=st.binary(min_size=1, max_size=4).filter(lambda b: any(x > 0x7F for x in b)))
def test_non_utf8_bytes_anywhere(tmp_path, position, raw) -> None:
    data = yaml.safe_dump(VALID).encode("utf-8")
    position = min(position, len(data))
    file = tmp_path / "bytes.yaml"
    file.write_bytes(data[:position] + raw + data[position:])
    try:
        raw.decode("utf-8")
        valid_utf8 = True
    except UnicodeDecodeError:
        valid_utf8 = False
    check(file)
    if not valid_utf8:
        try:
            load_patchset(file)
        except PatchsetError as err:
            assert "not valid UTF-8" in str(err) and err.line is not None
