"""Where a patchset name leads: the bundled ``patchsets/`` folder first, then paths."""

from __future__ import annotations

import os
from pathlib import Path

from engine.errors import PatchsetError

_YAML_EXT = (".yaml", ".yml")


def bundled_dir() -> Path:
    """The folder of the bundled patchsets.

    ``engine/_bundled/patchsets`` when it exists (a wheel install), else ``patchsets/`` next to
    the ``engine`` package (a source checkout or an editable install).
    """
    package = Path(__file__).resolve().parent.parent  # engine/, above engine/loader/
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
