"""Self-verification verdicts on disk: one JSON file per key, trusted only where only the user could have written it.

Why a cache: verifying a patchset on a release outside its range costs seconds (a tiny model,
the whole verifier); a training script applies it once per process, per rank, per run. A
verdict depends only on what its key holds (:mod:`engine.releases.key`), so the second apply
costs a file read.

Why trust is the folder's, not the entry's: an entry's checksum is an unkeyed sha256 of its
own content, so anyone who can write a file there can write a valid-looking "passed". The
checksum catches damage (a truncated write, an edit by hand); what keeps a verdict the user's
is where it lies, checked as ssh checks ``~/.ssh``:

* **Where**: ``$PATCH_ENGINE_CACHE_DIR`` if set (an absolute path), else
  ``$XDG_CACHE_HOME/patch-engine``, else ``~/.cache/patch-engine``; verdicts in its
  ``release-verdicts/`` folder. Both folders are created ``0700``.
* **Trusted folders only**: the cache folder and ``release-verdicts/`` must be owned by the
  current user and not writable by group or others; ``release-verdicts/`` must not be a
  symlink; ``$PATCH_ENGINE_CACHE_DIR`` must be absolute. Otherwise: one
  :class:`VerdictCacheWarning` saying why and how to fix it, and a fresh verification whose
  verdict is used and *not written* (an entry there would never be read again, and writing into
  a folder others control hands them a file of ours), and no lock is taken there.
* **Entries read as regular files only**: opened without following a symlink, non-blocking (a
  FIFO never blocks), checked to be a regular file owned by the user and not writable by group
  or others, at most :data:`MAX_ENTRY_BYTES`. Anything else, and a corrupt, edited or foreign
  entry (not JSON, another format, a checksum that does not match, a key material that is not
  this one's), is a warning and a fresh verification, whose entry replaces it (a rename
  replaces a symlink or FIFO itself, never what it points at).
* **An unwritable folder**: a warning; the verification runs and its verdict is used, not kept.
* **Ranks of one ``torchrun`` at once**: the first to take the key's lock (``fcntl.flock`` on a
  ``.lock`` file beside the entry, opened without following a symlink) verifies; the others
  wait for it, then read its verdict. The wait has a limit (:data:`LOCK_TIMEOUT_ENV_VAR`,
  default :data:`LOCK_TIMEOUT_S`): a lock held longer is a warning, and this process verifies
  without it. An entry is written to a temporary file and renamed over the final name, so a
  reader sees a whole entry or none. Where locking is unavailable (no ``fcntl``, a file system
  without locks), each process verifies and the last rename wins: one valid entry, the same verdict.

What this does not protect against: anything that runs as the user (their own processes, a
compromised account) can write a trusted entry; root can write anywhere. See docs/versions.md,
"The cache's threat model".
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import secrets
import stat
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from engine.errors import VerdictCacheWarning

__all__ = ["CACHE_ENV_VAR", "FORMAT", "LOCK_TIMEOUT_ENV_VAR", "LOCK_TIMEOUT_S", "MAX_ENTRY_BYTES", "VerdictStore",
           "cache_dir"]

CACHE_ENV_VAR = "PATCH_ENGINE_CACHE_DIR"
#: Seconds to wait for another process's lock on a key before verifying without it.
LOCK_TIMEOUT_ENV_VAR = "PATCH_ENGINE_CACHE_LOCK_TIMEOUT"
#: Longer than a self-verification takes (0.2-14 s measured, docs/versions.md), so ranks of one
#: run still wait for the one that verifies; short enough that a stuck lock costs minutes, not forever.
LOCK_TIMEOUT_S = 120.0
#: An entry is a few kB (its finding included); a larger file is not an entry, and is not read into memory.
MAX_ENTRY_BYTES = 1 << 20
#: Bumped when an entry's layout changes: an entry of another format is not read.
FORMAT = 1

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: POSIX: folders held open and files opened relative to them (no path is looked up twice). Elsewhere
#: (Windows) paths are used and ownership is not checked: the user's profile folder's ACLs decide.
_POSIX = hasattr(os, "geteuid") and os.open in os.supports_dir_fd and bool(_O_NOFOLLOW) and bool(_O_DIRECTORY)


def cache_dir() -> Path:
    """The engine's per-user cache folder (see the module docstring); not created here.

    A relative ``$PATCH_ENGINE_CACHE_DIR`` is returned as given; :class:`VerdictStore` does not trust it.
    """
    own = os.environ.get(CACHE_ENV_VAR, "").strip()
    if own:
        return Path(own).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    base = Path(xdg).expanduser() if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "patch-engine"


def lock_timeout() -> float:
    """Seconds to wait for a key's lock: ``$PATCH_ENGINE_CACHE_LOCK_TIMEOUT``, else :data:`LOCK_TIMEOUT_S`."""
    text = os.environ.get(LOCK_TIMEOUT_ENV_VAR, "").strip()
    if not text:
        return LOCK_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also NaN
        _warn(f"${LOCK_TIMEOUT_ENV_VAR}={text[:40]!r} is not a number of seconds >= 0; waiting at most "
              f"{LOCK_TIMEOUT_S:g} s for a verdict's lock")
        return LOCK_TIMEOUT_S
    return value


def _not_private(st: os.stat_result) -> str | None:
    """Why a file or folder with this ``stat`` may have been written by someone else (``None``: only by the user)."""
    if not _POSIX:
        return None
    uid = os.geteuid()
    if st.st_uid != uid:
        return f"it is owned by uid {st.st_uid}, not by you (uid {uid})"
    writable = [who for who, bit in (("group", stat.S_IWGRP), ("others", stat.S_IWOTH)) if st.st_mode & bit]
    if writable:
        return f"it is writable by {' and '.join(writable)} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


class VerdictStore:
    """The ``release-verdicts`` folder of :func:`cache_dir` (or ``root``).

    After any call, :attr:`untrusted` says why its entries are not trusted (``None``: they are,
    or the folder was not looked at yet). Untrusted: read and lock find nothing, write keeps nothing.
    """

    def __init__(self, root: Path | None = None):
        self.root = root if root is not None else cache_dir()
        self.folder = self.root / "release-verdicts"
        self.untrusted: str | None = None
        if not self.root.is_absolute():
            self.untrusted = (f"the cache folder {str(self.root)[:200]!r} is a relative path, so it would change with "
                              f"the working folder; set ${CACHE_ENV_VAR} to an absolute path")
        self._warned = False

    def path(self, key: str) -> Path:
        return self.folder / f"{key}.json"

    # ---- the folder --------------------------------------------------------------------------

    def _distrust(self, why: str) -> None:
        self.untrusted = why
        self._say_untrusted()

    def _say_untrusted(self) -> None:
        if not self._warned and self.untrusted:
            self._warned = True
            _warn(f"cached verdicts are not trusted: {self.untrusted}. Verifying again; this verdict is used and not "
                  "kept there (an entry is written only where it would be trusted)", about=self.root)

    @contextlib.contextmanager
    def _opened(self, create: bool) -> Iterator[int | None]:
        """The verdict folder, open (a file descriptor on POSIX, else -1), once both folders are trusted.

        ``None``: absent (and not ``create``d), untrusted (warned once), or not creatable (``OSError``
        raised only when ``create``, for :meth:`write` to report).
        """
        if self.untrusted:
            self._say_untrusted()
            yield None
            return
        if not _POSIX:
            if create:
                self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            yield -1 if self.folder.is_dir() else None
            return
        if create and not os.path.lexists(self.root):
            self.root.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                os.mkdir(self.root, 0o700)
        try:
            root = os.open(self.root, os.O_RDONLY | _O_DIRECTORY | _O_CLOEXEC)  # a link to the folder is the user's choice
        except FileNotFoundError:
            yield None
            return
        except OSError:
            if create:
                raise
            yield None  # not a folder, or not ours to open: nothing to read
            return
        try:
            why = _not_private(os.fstat(root))
            if why:
                self._distrust(f"the cache folder {self.root} is not private: {why}; fix: chmod go-w {self.root} "
                               f"(owned by you), or set ${CACHE_ENV_VAR} to a folder of your own")
                yield None
                return
            flags = os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_CLOEXEC
            try:
                folder = os.open("release-verdicts", flags, dir_fd=root)
            except FileNotFoundError:
                if not create:
                    yield None
                    return
                with contextlib.suppress(FileExistsError):
                    os.mkdir("release-verdicts", 0o700, dir_fd=root)
                folder = os.open("release-verdicts", flags, dir_fd=root)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                self._distrust(f"{self.folder} is a symlink or not a folder; remove it (it is recreated)")
                yield None
                return
            try:
                why = _not_private(os.fstat(folder))
                if why:
                    self._distrust(f"the folder {self.folder} is not private: {why}; fix: chmod go-w {self.folder}")
                    yield None
                    return
                yield folder
            finally:
                os.close(folder)
        finally:
            os.close(root)

    def _open_at(self, folder: int, name: str, flags: int, mode: int = 0o600) -> int:
        if folder >= 0:
            return os.open(name, flags | _O_NOFOLLOW | _O_CLOEXEC, mode, dir_fd=folder)
        return os.open(self.folder / name, flags | _O_CLOEXEC, mode)

    # ---- entries -----------------------------------------------------------------------------

    def read(self, key: str, material: dict[str, Any]) -> dict[str, Any] | None:
        """The entry stored under ``key`` if it is trusted, whole and for exactly ``material``; else ``None``.

        A file that exists but cannot be used is a :class:`VerdictCacheWarning` (a fresh verification replaces it).
        """
        path = self.path(key)
        try:
            with self._opened(create=False) as folder:
                if folder is None:
                    return None
                data = self._read_entry(folder, path)
        except OSError as exc:
            _warn(f"cannot read the cached verdict {path} ({exc.strerror or exc}); verifying again", about=path)
            return None
        if data is None:
            return None
        try:
            entry = json.loads(data.decode("utf-8"))
        except ValueError as exc:
            _warn(f"ignored the cached verdict {path}: not JSON ({str(exc)[:200]}); verifying again and overwriting it",
                  about=path)
            return None
        problem = _unusable(entry, material)
        if problem:
            _warn(f"ignored the cached verdict {path}: {problem}; verifying again and overwriting it", about=path)
            return None
        return entry

    def _read_entry(self, folder: int, path: Path) -> bytes | None:
        """The bytes of a regular, private, small entry file; ``None`` (warned where it exists) otherwise."""
        if folder < 0 and path.is_symlink():
            _warn(f"ignored the cached verdict {path}: it is a symlink, not followed; verifying again and replacing it",
                  about=path)
            return None
        try:
            fd = self._open_at(folder, path.name, os.O_RDONLY | _O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                _warn(f"ignored the cached verdict {path}: it is a symlink, not followed; verifying again and "
                      "replacing it", about=path)
                return None
            raise
        try:
            st = os.fstat(fd)
            why = None
            if not stat.S_ISREG(st.st_mode):
                why = "not a regular file (a FIFO, device or folder), not read"
            elif st.st_size > MAX_ENTRY_BYTES:
                why = f"{st.st_size:,} bytes, larger than an entry can be ({MAX_ENTRY_BYTES:,}), not read"
            elif (private := _not_private(st)) is not None:
                why = f"not private ({private}), so not necessarily written by you"
            if why:
                _warn(f"ignored the cached verdict {path}: {why}; verifying again and replacing it", about=path)
                return None
            chunks, size = [], 0
            while size <= MAX_ENTRY_BYTES:
                chunk = os.read(fd, MAX_ENTRY_BYTES + 1 - size)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            if size > MAX_ENTRY_BYTES:  # it grew after fstat
                _warn(f"ignored the cached verdict {path}: larger than {MAX_ENTRY_BYTES:,} bytes; verifying again",
                      about=path)
                return None
            return b"".join(chunks)
        finally:
            os.close(fd)

    def write(self, key: str, entry: dict[str, Any]) -> Path | None:
        """Write ``entry`` under ``key`` atomically; its path, or ``None`` where it is not kept (warned)."""
        path = self.path(key)
        data = (json.dumps({"format": FORMAT, **entry, "checksum": _checksum(entry)}, indent=2, sort_keys=True)
                + "\n").encode("utf-8")
        if len(data) > MAX_ENTRY_BYTES:
            _warn(f"the verdict for {path} is {len(data):,} bytes, more than an entry may be ({MAX_ENTRY_BYTES:,}); "
                  "it was used for this apply and not kept")
            return None
        try:
            with self._opened(create=True) as folder:
                if folder is None:
                    return None  # untrusted: said so already
                tmp = f".{key}.{secrets.token_hex(8)}.tmp"
                fd = self._open_at(folder, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
                try:
                    with os.fdopen(fd, "wb") as f:
                        f.write(data)
                    if folder >= 0:
                        os.replace(tmp, path.name, src_dir_fd=folder, dst_dir_fd=folder)
                    else:
                        os.replace(self.folder / tmp, path)
                except BaseException:
                    with contextlib.suppress(OSError):
                        if folder >= 0:
                            os.unlink(tmp, dir_fd=folder)
                        else:
                            os.unlink(self.folder / tmp)
                    raise
        except OSError as exc:
            _warn(f"cannot write the verdict to {path} ({exc.strerror or exc}); it was used for this apply and not "
                  f"kept, so the next apply verifies again. Set ${CACHE_ENV_VAR} to a writable folder")
            return None
        return path

    # ---- the lock ----------------------------------------------------------------------------

    @contextlib.contextmanager
    def lock(self, key: str) -> Iterator[bool]:
        """Hold the key's lock for the block (other processes wait, up to :func:`lock_timeout`); yields whether held."""
        try:
            import fcntl
        except ImportError:  # Windows: no flock; each process verifies, the atomic rename keeps one entry
            yield False
            return
        handle = None
        try:
            with self._opened(create=True) as folder:
                if folder is not None:
                    handle = self._lock_file(folder, key)
        except OSError:
            handle = None  # unwritable: write() says so
        if handle is None:
            yield False
            return
        try:
            yield _acquire(fcntl, handle, self.folder / f"{key}.lock")
        finally:
            os.close(handle)  # releases the lock

    def _lock_file(self, folder: int, key: str) -> int | None:
        """The key's lock file, open; ``None`` (warned) where it is a symlink or not a regular file."""
        where = self.folder / f"{key}.lock"
        try:
            fd = self._open_at(folder, where.name, os.O_RDWR | os.O_CREAT | _O_NONBLOCK)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            _warn(f"the lock {where} is a symlink, not followed (nothing was created where it points); verifying "
                  "without the lock. Remove it")
            return None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            _warn(f"the lock {where} is not a regular file; verifying without the lock. Remove it")
            return None
        return fd


def _acquire(fcntl: Any, fd: int, where: Path) -> bool:
    """Take the lock on ``fd``, polling up to :func:`lock_timeout`; ``False`` (warned where timed out) if not taken."""
    timeout = lock_timeout()
    deadline = time.monotonic() + timeout
    pause = 0.01
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError:  # a file system without locks
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            _warn(f"another process has held the lock {where} for more than {timeout:g} s (${LOCK_TIMEOUT_ENV_VAR}); "
                  "verifying without it")
            return False
        time.sleep(min(pause, left))
        pause = min(pause * 2, 0.25)


def _unusable(entry: Any, material: dict[str, Any]) -> str | None:
    """Why ``entry`` cannot stand for a verification with ``material`` (``None``: it can)."""
    if not isinstance(entry, dict):
        return "not an entry (a JSON object)"
    if entry.get("format") != FORMAT:
        return f"format {str(entry.get('format'))[:40]!r}, this engine writes {FORMAT}"
    if entry.get("material") != material:
        return "made for other versions, settings or patchset content than this apply's (its key does not match)"
    if not isinstance(entry.get("passed"), bool) or not isinstance(entry.get("finding"), str):
        return "incomplete (no verdict)"
    body = {k: v for k, v in entry.items() if k not in ("format", "checksum")}
    if entry.get("checksum") != _checksum(body):
        return "its checksum does not match its content (edited or damaged)"
    return None


def _checksum(entry: dict[str, Any]) -> str:
    """sha256 of an entry's content: integrity against damage (a truncated write, a stray edit), not authentication.

    Anyone who can write the file can recompute it; what makes an entry the user's is the folder
    it lies in (:class:`VerdictStore`).
    """
    return hashlib.sha256(json.dumps(entry, sort_keys=True).encode()).hexdigest()


#: What was said about which file as it was then: (message, identity). An apply reads its key twice (whether it
#: is cached, then under the lock), so a bad entry or an untrusted folder was warned about twice per apply.
_SAID: set[tuple[str, tuple[int, ...] | None]] = set()


def _identity(path: Path) -> tuple[int, ...] | None:
    """The file or folder at ``path`` as it is now (not followed); ``None`` where it cannot be looked at."""
    try:
        st = os.lstat(path)
    except (OSError, ValueError):
        return None
    return st.st_dev, st.st_ino, st.st_mode, st.st_uid, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _warn(message: str, about: Path | None = None) -> None:
    """Warn once per cause: a message ``about`` a file is said again only once that file changed (a bad entry
    is replaced by the fresh verdict; an untrusted folder, until fixed, is said once per process)."""
    if about is not None:
        cause = (message, _identity(about))
        if cause in _SAID:
            return
        if len(_SAID) > 4096:  # a long-lived process: forget, never grow without bound
            _SAID.clear()
        _SAID.add(cause)
    warnings.warn(f"patch-engine: {message}", VerdictCacheWarning, stacklevel=4)
