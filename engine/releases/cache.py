"""Self-verification verdicts on disk: one JSON file per key, written atomically, one verifier per key at a time.

Why a cache: verifying a patchset on a release outside its range costs seconds (a tiny model,
the whole verifier); a training script applies it once per process, per rank, per run. A
verdict depends only on what its key holds (:mod:`engine.releases.key`), so the second apply
costs a file read.

What may go wrong, and what it does (never a crash, never a stale pass):

* **Where**: ``$PATCH_ENGINE_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/patch-engine``, else
  ``~/.cache/patch-engine``; verdicts in its ``release-verdicts/`` folder.
* **A corrupt, edited or foreign file** (not JSON, another format, a checksum that does not
  match its content, a key material that is not this one's): ignored with a warning, verified
  again, and overwritten.
* **An unwritable folder**: a warning; the verification runs and its verdict is used, not kept.
* **Ranks of one ``torchrun`` at once**: the first to take the key's lock (``fcntl.flock`` on a
  ``.lock`` file beside the entry) verifies; the others wait for it, then read its verdict. An
  entry is written to a temporary file and renamed over the final name, so a reader sees a
  whole entry or none. Where locking is unavailable (no ``fcntl``, a file system without locks),
  each process verifies and the last rename wins: one valid entry, the same verdict.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.errors import VerdictCacheWarning

__all__ = ["CACHE_ENV_VAR", "FORMAT", "VerdictStore", "cache_dir"]

CACHE_ENV_VAR = "PATCH_ENGINE_CACHE_DIR"
#: Bumped when an entry's layout changes: an entry of another format is not read.
FORMAT = 1


def cache_dir() -> Path:
    """The engine's per-user cache folder (see the module docstring); not created here."""
    own = os.environ.get(CACHE_ENV_VAR, "").strip()
    if own:
        return Path(own).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "patch-engine"


class VerdictStore:
    """The ``release-verdicts`` folder of :func:`cache_dir` (or ``root``)."""

    def __init__(self, root: Path | None = None):
        self.folder = (root if root is not None else cache_dir()) / "release-verdicts"

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.json"

    def read(self, key: str, material: dict[str, Any]) -> dict[str, Any] | None:
        """The entry stored under ``key`` if it is whole and for exactly ``material``; else ``None``.

        A file that exists but cannot be used is a :class:`VerdictCacheWarning` (it will be overwritten).
        """
        path = self.path(key)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as exc:
            _warn(f"cannot read the cached verdict {path} ({exc}); verifying again")
            return None
        try:
            entry = json.loads(text)
        except ValueError as exc:
            _warn(f"ignored the cached verdict {path}: not JSON ({exc}); verifying again and overwriting it")
            return None
        problem = _unusable(entry, material)
        if problem:
            _warn(f"ignored the cached verdict {path}: {problem}; verifying again and overwriting it")
            return None
        return entry

    def write(self, key: str, entry: dict[str, Any]) -> Path | None:
        """Write ``entry`` under ``key`` atomically; its path, or ``None`` (with a warning) where it cannot."""
        path = self.path(key)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{key}.", suffix=".tmp")
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump({"format": FORMAT, **entry, "checksum": _checksum(entry)}, f, indent=2, sort_keys=True)
                    f.write("\n")
                os.replace(tmp, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        except OSError as exc:
            _warn(f"cannot write the verdict to {path} ({exc}); it was used for this apply and not kept, so the "
                  f"next apply verifies again. Set ${CACHE_ENV_VAR} to a writable folder")
            return None
        return path

    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[bool]:
        """Hold the key's lock for the block (other processes wait); yields whether a lock is held."""
        try:
            import fcntl
        except ImportError:  # Windows: no flock; each process verifies, the atomic rename keeps one entry
            yield False
            return
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            handle = open(self.folder / f"{self.path(key).stem}.lock", "a+b")  # noqa: SIM115  (closed below)
        except OSError:
            yield False  # unwritable: write() says so
            return
        try:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
                held = True
            except OSError:  # a file system without locks
                held = False
            yield held
        finally:
            handle.close()  # releases the lock


def _unusable(entry: Any, material: dict[str, Any]) -> str | None:
    """Why ``entry`` cannot stand for a verification with ``material`` (``None``: it can)."""
    if not isinstance(entry, dict):
        return "not an entry (a JSON object)"
    if entry.get("format") != FORMAT:
        return f"format {entry.get('format')!r}, this engine writes {FORMAT}"
    if entry.get("material") != material:
        return "made for other versions, settings or patchset content than this apply's (its key does not match)"
    if not isinstance(entry.get("passed"), bool) or not isinstance(entry.get("finding"), str):
        return "incomplete (no verdict)"
    body = {k: v for k, v in entry.items() if k not in ("format", "checksum")}
    if entry.get("checksum") != _checksum(body):
        return "its checksum does not match its content (edited or damaged)"
    return None


def _checksum(entry: dict[str, Any]) -> str:
    """sha256 of an entry's content: an edited verdict (a failure turned into a pass) is not read."""
    return hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()


def _warn(message: str) -> None:
    warnings.warn(f"patch-engine: {message}", VerdictCacheWarning, stacklevel=4)
