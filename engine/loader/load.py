"""``load_patchset``: read, merge ``extends``, validate, and remember where each patch is written."""

from __future__ import annotations

import copy
import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pydantic import ValidationError

from engine.errors import PatchsetError
from engine.loader.extends import load_raw
from engine.loader.messages import Origin, Path_, combine, validation_errors
from engine.loader.names import resolve
from engine.loader.yaml_lines import parse_yaml, read_text
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
    if errors:
        raise combine(errors, files)
    patchset._files = tuple(f for f in dict.fromkeys(files) if f is not None)
    patchset._origins = {
        path[1:]: origin for path, origin in origins.items() if len(path) in (2, 3) and path[0] == "patches"
    }
    return patchset


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
            data = copy.deepcopy(source)
            return _finish(data, {}, None, [], [None])
        if not isinstance(source, (str, os.PathLike)):
            raise PatchsetError(f"a patchset source is a name, a path or a dict, not {type(source).__name__}")
        path = resolve(source)  # absolute; refuses, unread, anything but a .yaml/.yml file
        shown = str(path)
        data, origins = parse_yaml(read_text(path, shown), shown)
        return _finish(data, origins, path.parent, [(path, shown)], [shown])
