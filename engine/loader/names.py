"""Where a patchset name leads: a bare name to the bundled ``patchsets/`` folder, a path to its file."""

from __future__ import annotations

import os
from pathlib import Path

from engine.errors import PatchsetError, shown_path

_YAML_EXT = (".yaml", ".yml")

_SEPARATORS = ("/", "\\", os.sep)


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


def _bundled_hint(text: str = "") -> str:
    """The bundled names nearest to what was typed, and where the rest are listed (not all 110 of them).

    Why summarised: a typo used to be answered with every bundled name on one line, past a
    screen's width, the one meant lost among them.
    """
    import difflib

    names = bundled_names()
    if not names:
        return "bundled patchsets: (none)"
    stem = Path(str(text)).name.removesuffix(".yaml").removesuffix(".yml").lower()
    near = difflib.get_close_matches(stem, names, n=5, cutoff=0.6) if stem else []
    if not near and stem:
        near = [n for n in names if n.startswith(stem[:4])][:5]
    common = [n for n in ("qwen3", "llama", "gemma3", "mistral") if n in names] or names[:4]
    shown = f"nearest: {', '.join(near)}; " if near else f"e.g. {', '.join(common)}; "
    return (f"bundled patchsets: {shown}{len(names)} in all, listed in docs/bundled_patchsets.md "
            "(engine.loader.bundled_names())")


def is_bare_name(text: str) -> bool:
    """``qwen3``: no folder, no ``.yaml``/``.yml`` suffix, not hidden. Such a name means a bundled patchset."""
    return bool(text) and not any(sep in text for sep in _SEPARATORS) and not text.startswith(".") and not (
        _has_yaml_suffix(text)
    )


def _has_yaml_suffix(name: str | Path) -> bool:
    return str(name).lower().endswith(_YAML_EXT)


def _bundled_file(stem: str) -> Path | None:
    """The bundled file of a name such as ``qwen3`` (or the stem of ``qwen3.yaml``), if any."""
    if not stem or any(sep in stem for sep in _SEPARATORS) or stem.startswith("."):
        return None
    candidate = bundled_dir() / f"{stem}.yaml"
    return candidate if candidate.is_file() else None


def _candidates(path: Path) -> list[Path]:
    """``path`` itself when it ends in .yaml/.yml, else ``path.yaml`` then ``path.yml``."""
    if not path.name:  # "/" or a drive root: no file name to complete
        return []
    if _has_yaml_suffix(path.name):
        return [path]
    return [path.with_name(path.name + ext) for ext in _YAML_EXT]


def _checked(path: Path, text: str) -> Path:
    """The real path of an existing patchset file; refused, unread, if it is not a .yaml/.yml file."""
    real = path.resolve()
    if not _has_yaml_suffix(real.name):  # a symlink named x.yaml that leads elsewhere
        raise PatchsetError(
            f"{text!r} leads to {str(real)!r}, which is not a .yaml/.yml file, so it is not read as a "
            f"patchset; give a bundled name or a .yaml/.yml file. {_bundled_hint(text)}",
            file=str(path.absolute()),
        )
    return real


def _not_a_patchset(text: str, path: Path) -> PatchsetError:
    if path.is_dir():
        problem = f"{text!r} is a folder, so it is not read as a patchset; give a bundled name or a .yaml/.yml file"
    else:
        problem = (
            f"{text!r} is not a .yaml/.yml file, so it is not read as a patchset; give a bundled name "
            "or a .yaml/.yml file (rename the file to .yaml if it is a patchset)"
        )
    return PatchsetError(f"{problem}. {_bundled_hint(str(path))}", file=str(path.absolute()))


def resolve(name_or_path: str | os.PathLike, relative_to: Path | str | os.PathLike | None = None) -> Path:
    """The patchset file a name or path means, as an absolute path (:func:`_resolve` says how).

    A name the file system refuses (5,000 characters: ``ENAMETOOLONG``; a NUL byte) is a
    :class:`PatchsetError` that shows the name by its ends, not a raw ``OSError`` echoing the path.
    """
    try:
        return _resolve(name_or_path, relative_to)
    except (OSError, ValueError) as exc:
        if isinstance(exc, PatchsetError):
            raise
        text = os.fsdecode(os.fspath(name_or_path)) if isinstance(name_or_path, (str, os.PathLike)) else name_or_path
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise PatchsetError(f"no patchset {text!r}: the file system cannot look it up ({why}); give a bundled name or "
                            f"a .yaml/.yml file. {_bundled_hint()}") from None


def _resolve(name_or_path: str | os.PathLike, relative_to: Path | str | os.PathLike | None = None) -> Path:
    """The patchset file a name or path means, as an absolute path.

    - A bare name (``qwen3``: no folder, no suffix) is the bundled patchset of that name; only
      when none is bundled, ``<folder>/qwen3.yaml`` (or ``.yml``).
    - Anything else is a path: ``qwen3.yaml``, ``./qwen3.yaml``, ``configs/qwen3``. An existing
      file wins (the copy being edited); a path without suffix also matches ``.yaml``/``.yml``.
      Only a plain file name (``qwen3.yaml``, no folder) that exists nowhere falls back to the
      bundled patchset of that stem, as Liger and LlamaFactory users type names. A
      :class:`os.PathLike` is always a path.
    - Paths are relative to ``relative_to`` (the extending file, or its folder), else to the
      working folder.

    Only ``.yaml``/``.yml`` files are patchsets: another existing file is refused without being
    read, so ``extends: ../../etc/passwd`` echoes nothing. Raises :class:`PatchsetError`,
    listing the bundled names, when nothing is found.
    """
    is_path_object = not isinstance(name_or_path, str)
    text = os.fsdecode(os.fspath(name_or_path))
    if not text:
        raise PatchsetError(f"empty patchset name; {_bundled_hint()}")
    folder = Path(relative_to) if relative_to is not None else Path.cwd()
    if relative_to is not None and folder.is_file():
        folder = folder.parent
    given = Path(text).expanduser()
    base = given if given.is_absolute() else folder / given
    bare = not is_path_object and is_bare_name(text)
    if bare:
        bundled = _bundled_file(text)
        if bundled is not None:
            return bundled
    tried: list[str] = []
    for candidate in _candidates(base):
        tried.append(str(candidate))
        if candidate.is_file():
            return _checked(candidate, text)
    if not _has_yaml_suffix(base.name) and base.exists():
        raise _not_a_patchset(text, base)
    if not is_path_object and not bare and given.name == text and _has_yaml_suffix(text):
        bundled = _bundled_file(text.rsplit(".", 1)[0])
        if bundled is not None:
            return bundled
    if is_path_object and _has_yaml_suffix(base.name):
        raise PatchsetError("no such file", file=str(base))
    looked = ", ".join(shown_path(t) for t in dict.fromkeys(tried))  # a NUL byte escaped, never printed raw
    what = "not a bundled name and no such file" if bare else "no such file"
    raise PatchsetError(f"no patchset {text!r}: {what} (looked at {looked}); {_bundled_hint(text)}")
