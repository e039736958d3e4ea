"""A self-verification verdict is trusted only where only the user could have written it (issue 38, item 3).

The entry's checksum is an unkeyed sha256, so a forged "passed" with a recomputed checksum is a
valid-looking entry: what must stop it is the folder it lies in, and how it is opened. Each case
here is an attacker's (or a stray file's) move; none may decide a verdict, none may block. The
store is driven directly (fast), and end to end through ``engine.apply`` with a patchset whose
norms are flipped (``one_plus_weight``) outside its verified range: a forged pass must never
let it patch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path
from typing import Any

import pytest
import transformers

import engine
from engine.loader import load_patchset
from engine.releases.cache import LOCK_TIMEOUT_ENV_VAR, MAX_ENTRY_BYTES, VerdictStore, _checksum
from engine.tiny import build_tiny_model

pytestmark = pytest.mark.skipif(not hasattr(os, "geteuid"), reason="POSIX ownership and modes")

ROOT = Path(__file__).resolve().parent.parent
MATERIAL = {"patchset": "mine", "engine": "x", "dtype": "fp32"}
KEY = "mine-0123456789abcdef0123456789abcdef"


def _forged(passed: bool = True) -> dict[str, Any]:
    """An entry anyone can write: a pass, its checksum recomputed as the engine computes it."""
    body = {"material": MATERIAL, "passed": passed, "finding": "", "verdict": {"passed": passed}}
    return {"format": 1, **body, "checksum": _checksum(body)}


def _store(tmp_path: Path) -> VerdictStore:
    store = VerdictStore(tmp_path / "cache")
    assert store.write(KEY, {k: v for k, v in _forged().items() if k not in ("format", "checksum")})
    return store


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATCH_ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PATCH_ENGINE_UNVERIFIED_RELEASE", raising=False)
    monkeypatch.delenv(LOCK_TIMEOUT_ENV_VAR, raising=False)


# ---- the store ---------------------------------------------------------------------------------


def test_a_trusted_folder_is_created_private_and_its_entry_is_read(tmp_path: Path) -> None:
    store = _store(tmp_path)
    assert (store.root.stat().st_mode & 0o777, store.folder.stat().st_mode & 0o777) == (0o700, 0o700)
    assert store.path(KEY).stat().st_mode & 0o777 == 0o600
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning on the ordinary path
        assert store.read(KEY, MATERIAL)["passed"] is True
    assert store.untrusted is None


@pytest.mark.parametrize("which", ["cache folder", "release-verdicts"])
@pytest.mark.parametrize("mode", [0o770, 0o707])
def test_a_forged_entry_in_a_group_or_world_writable_folder_is_not_read_nor_written(
        tmp_path: Path, which: str, mode: int) -> None:
    store = _store(tmp_path)
    store.path(KEY).write_text(json.dumps(_forged()))  # recomputed checksum: valid but for its folder
    (store.root if which == "cache folder" else store.folder).chmod(mode)
    fresh = VerdictStore(store.root)
    with pytest.warns(engine.VerdictCacheWarning, match=r"not trusted: .*not private: it is writable by (group|others)"):
        assert fresh.read(KEY, MATERIAL) is None
    stamp = store.path(KEY).stat().st_mtime_ns
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per store
        assert fresh.write(KEY, {"material": MATERIAL, "passed": False, "finding": "x", "verdict": {}}) is None
        with fresh.lock(KEY) as held:
            assert not held  # no lock in a folder others control
    assert store.path(KEY).stat().st_mtime_ns == stamp  # nothing written there


def test_a_folder_owned_by_another_user_is_not_trusted(tmp_path: Path) -> None:
    store = _store(tmp_path)
    if os.geteuid() != 0:
        pytest.skip("changing a folder's owner needs root")
    os.chown(store.folder, 12345, -1)
    with pytest.warns(engine.VerdictCacheWarning, match="owned by uid 12345, not by you"):
        assert VerdictStore(store.root).read(KEY, MATERIAL) is None


def test_an_entry_that_is_a_symlink_to_a_forged_entry_is_not_followed_and_is_replaced(tmp_path: Path) -> None:
    store = _store(tmp_path)
    forged = tmp_path / "elsewhere.json"
    forged.write_text(json.dumps(_forged()))
    store.path(KEY).unlink()
    store.path(KEY).symlink_to(forged)
    with pytest.warns(engine.VerdictCacheWarning, match="symlink, not followed"):
        assert store.read(KEY, MATERIAL) is None
    assert store.write(KEY, {"material": MATERIAL, "passed": False, "finding": "f", "verdict": {}})
    assert not store.path(KEY).is_symlink() and json.loads(forged.read_text())["passed"] is True  # target untouched


@pytest.mark.parametrize("what", ["/dev/zero", "oversized", "folder"])
def test_a_device_an_oversized_file_or_a_folder_is_not_read(tmp_path: Path, what: str) -> None:
    store = _store(tmp_path)
    entry = store.path(KEY)
    entry.unlink()
    if what == "/dev/zero":
        entry.symlink_to("/dev/zero")
    elif what == "folder":
        entry.mkdir()
    else:
        entry.write_bytes(b" " * (MAX_ENTRY_BYTES + 1))
    expected = {"/dev/zero": "symlink", "oversized": "larger than an entry", "folder": "not a regular file"}[what]
    with pytest.warns(engine.VerdictCacheWarning, match=expected):
        assert store.read(KEY, MATERIAL) is None


_READ_FIFO = textwrap.dedent("""
    import sys, warnings
    from pathlib import Path
    from engine.releases.cache import VerdictStore
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        entry = VerdictStore(Path(sys.argv[1])).read(sys.argv[2], {})
    print(entry, [str(w.message) for w in caught])
""")


def test_an_entry_that_is_a_fifo_does_not_block(tmp_path: Path) -> None:
    store = _store(tmp_path)
    store.path(KEY).unlink()
    os.mkfifo(store.path(KEY))  # nobody writes to it: a blocking open would wait forever
    done = subprocess.run([sys.executable, "-c", _READ_FIFO, str(store.root), KEY], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("None") and "not a regular file" in done.stdout


def test_a_lock_that_is_a_symlink_creates_nothing_where_it_points(tmp_path: Path) -> None:
    store = _store(tmp_path)
    target = tmp_path / "victim" / "created-by-the-engine"
    target.parent.mkdir()
    (store.folder / f"{KEY}.lock").symlink_to(target)
    with pytest.warns(engine.VerdictCacheWarning, match="lock .* is a symlink, not followed"):
        with store.lock(KEY) as held:
            assert not held
    assert not target.exists() and not list(target.parent.iterdir())


_HOLD = textwrap.dedent("""
    import fcntl, os, sys, time
    fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    print("held", flush=True)
    time.sleep(600)
""")


@pytest.fixture
def held_lock(tmp_path: Path):
    """Another process holding a key's lock (the engine's lock file for ``KEY``) until the test ends."""
    def hold(path: Path) -> subprocess.Popen:
        holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline().strip() == "held"
        holders.append(holder)
        return holder
    holders: list[subprocess.Popen] = []
    yield hold
    for holder in holders:
        holder.kill()
        holder.wait()


def test_a_lock_held_by_another_process_is_waited_for_at_most_the_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held_lock) -> None:
    store = _store(tmp_path)
    held_lock(store.folder / f"{KEY}.lock")
    monkeypatch.setenv(LOCK_TIMEOUT_ENV_VAR, "0.5")
    with pytest.warns(engine.VerdictCacheWarning, match=r"held the lock .* for more than 0.5 s"):
        with store.lock(KEY) as held:
            assert not held
            assert store.read(KEY, MATERIAL)["passed"] is True  # the folder is still trusted


def test_a_relative_cache_folder_is_not_trusted_and_nothing_is_created(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATCH_ENGINE_CACHE_DIR", "relative/cache")
    store = VerdictStore()
    assert "relative path" in (store.untrusted or "")
    with pytest.warns(engine.VerdictCacheWarning, match="relative path"):
        with store.lock(KEY) as held:
            assert not held
            assert store.read(KEY, MATERIAL) is None
            assert store.write(KEY, {"material": MATERIAL, "passed": True, "finding": "", "verdict": {}}) is None
    assert not (tmp_path / "relative").exists()


# ---- end to end: a flipped patchset outside its range is refused whatever the cache holds --------


def _flipped(tmp_path: Path) -> Path:
    data = load_patchset("qwen3").model_dump(mode="json", exclude_none=True)
    data["requires"] = {"transformers": f"<{transformers.__version__}"}  # outside: self-verified
    data["patches"][0]["scale"] = "one_plus_weight"  # the mistake that doubled a Qwen3-8B loss
    path = tmp_path / "flipped.yaml"
    import yaml

    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _model() -> Any:
    return build_tiny_model("qwen3", dict(load_patchset("qwen3").tiny_model.config))


def _forge_pass(entry: Path) -> None:
    """Turn a cached failure into a pass and recompute its checksum, as anyone who can write the file can."""
    stored = json.loads(entry.read_text())
    stored["passed"], stored["finding"], stored["verdict"]["passed"], stored["verdict"]["finding"] = True, "", True, ""
    body = {k: v for k, v in stored.items() if k not in ("format", "checksum")}
    stored["checksum"] = _checksum(body)
    entry.unlink()
    entry.write_text(json.dumps(stored))


@pytest.mark.parametrize("move", ["group-writable folder", "symlinked entry"])
def test_a_forged_pass_never_lets_a_flipped_patchset_patch(tmp_path: Path, move: str) -> None:
    cache = tmp_path / "cache"
    flipped, model = _flipped(tmp_path), _model()
    with pytest.raises(engine.ReleaseVerificationFailed):
        engine.apply(model, flipped, device="cpu")  # refused, its failure cached
    (entry,) = (cache / "release-verdicts").glob("*.json")
    if move == "group-writable folder":
        _forge_pass(entry)
        (cache / "release-verdicts").chmod(0o775)
        expected = "not private: it is writable by group"
    else:
        elsewhere = tmp_path / "forged.json"
        elsewhere.write_text(entry.read_text())
        _forge_pass(elsewhere)
        entry.unlink()
        entry.symlink_to(elsewhere)
        expected = "symlink, not followed"
    with pytest.warns(engine.VerdictCacheWarning, match=expected), \
            pytest.raises(engine.ReleaseVerificationFailed) as info:
        engine.apply(model, flipped, device="cpu")
    assert not info.value.verdict.cached and not engine.is_patched(model)  # verified afresh, refused afresh
    if move == "group-writable folder":  # and not written there: the verdict says why, not "not writable"
        assert info.value.verdict.where().startswith("not cached (its entries are not trusted: "), info.value.verdict.where()


def test_an_apply_behind_a_held_lock_verifies_after_the_timeout(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, held_lock) -> None:
    flipped, model = _flipped(tmp_path), _model()
    with pytest.raises(engine.ReleaseVerificationFailed):
        engine.apply(model, flipped, device="cpu")
    (entry,) = (tmp_path / "cache" / "release-verdicts").glob("*.json")
    entry.unlink()
    held_lock(entry.with_suffix(".lock"))  # another process sits on this apply's key (it used to wait forever)
    monkeypatch.setenv(LOCK_TIMEOUT_ENV_VAR, "1")
    with pytest.warns(engine.VerdictCacheWarning, match="held the lock"), \
            pytest.raises(engine.ReleaseVerificationFailed) as info:
        engine.apply(model, flipped, device="cpu")
    assert not info.value.verdict.cached and not engine.is_patched(model)  # verified without the lock, refused
