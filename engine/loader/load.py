"""``load_patchset``: read, merge ``extends``, validate, and remember where each patch is written."""

from __future__ import annotations

import difflib
import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from engine.errors import PatchsetError, shown_path
from engine.loader.extends import load_raw
from engine.loader.messages import Origin, Path_, combine, error_at, key_text, validation_errors
from engine.loader.names import resolve
from engine.loader.yaml_lines import MAX_DEPTH, parse_yaml, read_text
from engine.schema import Patchset


def _finish(
    data: dict,
    origins: dict[Path_, Origin],
    folder: Path | None,
    chain: list[tuple[Path, str]],
    files: list[str | None],
) -> Patchset:
    errors: list[PatchsetError] = []
    data, origins = load_raw(data, origins, folder, chain, errors, files)
    try:
        patchset = Patchset.model_validate(data)
    except ValidationError as exc:
        errors.extend(validation_errors(exc, data, origins, have_duplicates=bool(errors)))
    else:
        errors.extend(_tiny_type_errors(patchset, origins))
    if errors:
        raise combine(errors, files)
    patchset._files = tuple(f for f in dict.fromkeys(files) if f is not None)
    patchset._origins = {
        path[1:]: origin for path, origin in origins.items() if len(path) in (2, 3) and path[0] == "patches"
    }
    return patchset


def _tiny_type_errors(patchset: Patchset, origins: dict[Path_, Origin]) -> list[PatchsetError]:
    """``tiny_model.model_type`` must be one of ``model_types``: the tiny model is what verifies the patchset.

    Why: ``model_type: qwen33`` (a typo) was dropped without a word, and ``patch-engine verify`` verified a
    tiny qwen3 instead; a type the patchset is not for could never be planned on anyway (ModelTypeMismatch).
    """
    tiny = patchset.tiny_model
    if tiny is None or tiny.model_type is None or tiny.model_type in patchset.model_types:
        return []
    types = list(dict.fromkeys(patchset.model_types))
    close = difflib.get_close_matches(tiny.model_type, types, n=3, cutoff=0.6)
    hint = (f"did you mean {' or '.join(repr(c) for c in close)}?" if close
            else f"write one of {', '.join(repr(t) for t in types[:20])}{' ...' if len(types) > 20 else ''}")
    problem = (f"{tiny.model_type!r} is not one of this patchset's model_types, so no tiny model of it can verify "
               f"the patchset; {hint} (or add it to model_types, or drop the key: the first model type is the "
               "default)")
    return [error_at(problem, ("tiny_model", "model_type"), origins)]


_SCALARS = (str, bool, int, float, type(None))


def plain_copy(value: Any, path: Path_ = ()) -> Any:
    """A copy of an in-memory patchset made of what YAML can write: mappings, lists, strings, numbers, booleans, null.

    Tuples become lists; a validated schema model (a patch) is copied as it is. Anything else (a generator, a
    set, an object), and nesting deeper than a file may nest (:data:`MAX_DEPTH`, which also ends a mapping that
    holds itself), is a :class:`PatchsetError` naming the key path and the fix; nothing is read from the value
    but its type.
    """
    if isinstance(value, _SCALARS):
        return value
    if len(path) >= MAX_DEPTH and isinstance(value, (dict, list, tuple)):
        raise PatchsetError(f"nested more than {MAX_DEPTH} levels deep (a mapping or list that holds itself?); a "
                            "patchset is a few levels deep: flatten it", key=key_text(path[:MAX_DEPTH]))
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, _SCALARS):
                raise PatchsetError(f"a key of type {type(key).__name__} is not patchset data; keys are strings",
                                    key=key_text(path))
            out[key] = plain_copy(item, path + (key if isinstance(key, str) else str(key),))
        return out
    if isinstance(value, (list, tuple)):
        return [plain_copy(item, path + (i,)) for i, item in enumerate(value)]
    if isinstance(value, BaseModel):  # a patch already validated (a RmsNormPatch): as it was, copied
        return value.model_copy(deep=True)
    hint = " (write it as a list: list(...))" if hasattr(value, "__iter__") else ""
    raise PatchsetError(f"a {type(value).__name__} is not patchset data: a patchset holds what YAML can write "
                        f"(mappings, lists, strings, numbers, true/false, null){hint}", key=key_text(path))


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a patchset loads.

    Why: loading allocates several objects per YAML node and frees almost none until it is
    done, so the collector's full passes walk an ever larger heap: half the time of a
    10,000-patch file. Nothing the loader builds needs the collector; it resumes afterwards.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


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
    file = shown_path(file)
    return f"{file}:{line}: " if line is not None else f"{file}: "


def load_patchset(source: str | os.PathLike | dict) -> Patchset:
    """Load and validate a patchset.

    Args:
        source: a bundled name (``"qwen3"``), a path (``"qwen3.yaml"``, ``"./configs/x.yaml"``,
            a :class:`~pathlib.Path`; an existing file wins over the bundled one, see
            :func:`engine.loader.resolve`), or an in-memory patchset (a dict; its errors have
            ``file=None``, its ``extends`` resolves relative to the working folder).
            ``patchset.files`` names the files actually read, as absolute paths.

    Raises:
        PatchsetError: every problem found, one line each, as ``file:line: key: problem``.
    """
    with _collector_paused():
        if isinstance(source, dict):
            data = plain_copy(source)  # not deepcopy: a generator was a raw TypeError, 5,000 levels a RecursionError
            return _finish(data, {}, None, [], [None])
        if not isinstance(source, (str, os.PathLike)):
            raise PatchsetError(f"a patchset source is a name, a path or a dict, not {type(source).__name__}")
        path = resolve(source)  # absolute; refuses, unread, anything but a .yaml/.yml file
        shown = str(path)
        data, origins = parse_yaml(read_text(path, shown), shown)
        return _finish(data, origins, path.parent, [(path, shown)], [shown])
