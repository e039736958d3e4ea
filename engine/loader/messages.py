"""Problems as people read them: pydantic errors rewritten as ``file:line: key: problem``.

Each pydantic error becomes one sentence that says what is wrong and what would be right
(the valid keys, the enum's values, a close match), placed at the line the offending key is
written on; every problem of a file is gathered into one :class:`PatchsetError`.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

from pydantic import ValidationError

from engine.errors import PatchsetError
from engine.loader.schema_types import model_at, union_tags

Path_ = tuple  # a data path such as ("patches", 1, "scale")


Origin = tuple  # (file or None, 1-based line)


def key_text(path: Path_) -> str | None:
    text = ""
    for element in path:
        if isinstance(element, int):
            text += f"[{element}]"
        elif re.fullmatch(r"[A-Za-z0-9_\-]+", element):
            text += ("." if text else "") + element
        else:
            text += f"[{element!r}]"
    return text or None


def describe(value: Any) -> str:
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


def kind_of(value: Any) -> str:
    """The kind of a value without the value itself (for data that may not be a patchset)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return describe(value)  # "a mapping", "a list", "a <type>": no content


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
        model = model_at(loc[:-1])
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
        return f"{name} {describe(tag)} is not one of {_quoted(tags)}{_did_you_mean(tag, tags)}", path
    if kind == "union_tag_not_found":
        name = str(ctx.get("discriminator", "'op'")).strip("'\"")
        tags = union_tags(loc, name)
        return f"missing required key {name!r}" + (f" (one of {_quoted(tags)})" if tags else ""), path
    if kind in ("enum", "literal_error"):
        return f"{describe(value)} is not one of {_quoted(_expected_values(err))}", path
    if kind in ("value_error", "assertion_error"):
        error = ctx.get("error")
        text = str(error) if error is not None else err["msg"]
        return re.sub(r"^(Value error|Assertion failed), ", "", text), path
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {describe(value)}", path
    if kind == "string_too_short":
        n = ctx.get("min_length", 1)
        return ("must not be empty" if n == 1 else f"must have at least {n} characters"), path
    if kind == "too_short":
        n = ctx.get("min_length", 1)
        return f"must have at least {n} item{'s' if n != 1 else ''}", path
    if kind == "string_pattern_mismatch":
        return f"{describe(value)} does not match the pattern {ctx.get('pattern')}", path
    if kind == "invalid_key":
        return f"key {describe(value)} is not a string", path
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


def locate(path: Path_, origins: dict[Path_, Origin]) -> Origin:
    for n in range(len(path), -1, -1):
        if path[:n] in origins:
            return origins[path[:n]]
    return (None, None)


def error_at(problem: str, path: Path_, origins: dict[Path_, Origin]) -> PatchsetError:
    file, line = locate(path, origins)
    return PatchsetError(problem, file=file, line=line, key=key_text(path))


#: Problems one error lists, one line each; the rest are counted ("... and 349,950 more problems"): 350,000
#: unknown keys once printed 72 MB, and writing each its own message took minutes.
MAX_PROBLEMS = 50


class Omitted(PatchsetError):
    """Problems found and counted but not described (past :data:`MAX_PROBLEMS`): ``count`` of them, by kind."""

    def __init__(self, kinds: dict[str, int]):
        self.kinds = kinds
        super().__init__(", ".join(f"{n:,} {kind}" for kind, n in kinds.items()))


def combine(errors: list[PatchsetError], file_order: list[str | None]) -> PatchsetError:
    """One error for many: the first's location as attributes, one line per problem as text.

    At most :data:`MAX_PROBLEMS` are listed (``errors`` holds those); a last line counts the rest
    (``count``: every problem found).
    """
    unique: dict[tuple, PatchsetError] = {}
    omitted: dict[str, int] = {}
    for e in errors:
        if isinstance(e, Omitted):
            for kind, n in e.kinds.items():
                omitted[kind] = omitted.get(kind, 0) + n
            continue
        unique.setdefault((e.file, e.line, e.key, e.problem), e)
    rank = {f: i for i, f in enumerate(dict.fromkeys(file_order))}
    ordered = sorted(
        unique.values(),
        key=lambda e: (rank.get(e.file, len(rank)), e.line if e.line is not None else 0),
    )
    if len(ordered) > MAX_PROBLEMS:
        omitted["other problems"] = omitted.get("other problems", 0) + len(ordered) - MAX_PROBLEMS
        ordered = ordered[:MAX_PROBLEMS]
    first = ordered[0] if ordered else PatchsetError("invalid patchset")
    combined = PatchsetError(first.problem, file=first.file, line=first.line, key=first.key)
    combined.errors = ordered
    combined.count = len(ordered) + sum(omitted.values())  # every problem found, listed or not
    lines = [str(e) for e in ordered]
    if omitted:
        more = sum(omitted.values())
        lines.append(f"... and {more:,} more problems not listed ({Omitted(omitted).problem}); fix those above and "
                     "validate again")
    if len(lines) > 1:
        combined.args = ("\n".join(lines),)
    return combined


def validation_errors(
    exc: ValidationError, data: dict, origins: dict[Path_, Origin], have_duplicates: bool
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
    # Paths some error lies strictly beneath, collected once (a scan per error was quadratic).
    above_an_error = {q[:n] for q, _ in found for n in range(len(q))}
    out: list[PatchsetError] = []
    done: set[Path_] = set()
    omitted: dict[str, set[tuple]] = {}
    for path, err in found:
        if len(out) >= MAX_PROBLEMS:  # counted, not described (a message each took 2 ms; 350,000 took minutes)
            union = path in unions and err["type"] in _WHOLE_INPUT
            if union and (path in above_an_error or path in done):
                continue  # listed already, or the error beneath it is the one counted
            kind = "unknown keys" if err["type"] == "extra_forbidden" else "other problems"
            omitted.setdefault(kind, set()).add((path, "union" if union else err["type"]))  # a union fails per member
            continue
        if path in unions and err["type"] in _WHOLE_INPUT:
            if path in above_an_error or path in done:
                continue
            done.add(path)
            wanted = list(dict.fromkeys(_expectation(e) for e in by_path[path]))
            wants = wanted[0] if len(wanted) == 1 else ", ".join(wanted[:-1]) + " or " + wanted[-1]
            out.append(error_at(f"expected {wants}, got {describe(err.get('input'))}", path, origins))
            continue
        if (not err["loc"]) and err["type"] == "value_error":
            match = re.match(r"(?:Value error, )?patches\[(\d+)\]", err["msg"])
            if match:
                path = ("patches", int(match.group(1)))
        try:
            problem, where = _message(err, data, path)
        except Exception:  # a message must never hide the error itself
            problem, where = err.get("msg", "invalid value"), path
        out.append(error_at(problem, where, origins))
    if omitted:
        out.append(Omitted({kind: len(problems) for kind, problems in omitted.items()}))
    return out
