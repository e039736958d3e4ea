"""``.ci/stack-installs``: the background builder of CI's stack venvs waits for disk room while an earlier stack
is still to be tested (and its venv freed), and goes ahead once none is. One CI run filled its disk with every
venv built ahead of its tests ("No space left on device" in the suite); this is the gate that prevents it.

Real bash and the real script, run on stub stacks whose ``install`` only writes a line: the disk is made "too
small" by asking for more headroom than any disk has.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _stubbed(tmp_path: Path, stacks: list[str]) -> Path:
    ci = tmp_path / ".ci"
    ci.mkdir()
    shutil.copy(REPO / ".ci" / "stack-installs", ci / "stack-installs")
    for stack in stacks:
        (ci / stack).write_text(f'#!/usr/bin/env bash\necho "built {stack} ($1)"\n')
    (tmp_path / "logs").mkdir()
    return tmp_path


def _wait_for(path: Path, seconds: float = 20.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if path.exists():
            return True
        time.sleep(0.05)
    return False


def test_each_install_waits_for_the_earlier_stacks_to_be_tested_when_the_disk_is_short(tmp_path) -> None:
    root = _stubbed(tmp_path, ["first", "second", "third"])
    logs = root / "logs"
    env = {"PATH": "/usr/bin:/bin", "CI_HEADROOM_GB": "100000000", "CI_DISK_POLL_S": "0.1"}
    builder = subprocess.Popen(["bash", str(root / ".ci" / "stack-installs"), str(logs), "first", "second", "third"],
                               env=env)
    try:
        assert _wait_for(logs / "install-first.rc")  # nothing earlier to wait for: it goes ahead
        time.sleep(0.6)
        assert not (logs / "install-second.rc").exists()  # first not tested yet: second waits
        (logs / "done-first").touch()
        assert _wait_for(logs / "install-second.rc")
        time.sleep(0.6)
        assert not (logs / "install-third.rc").exists()
        (logs / "done-second").touch()
        assert _wait_for(logs / "install-third.rc")
        assert builder.wait(timeout=20) == 0
    finally:
        builder.kill()
    rc, _, waited = (logs / "install-second.rc").read_text().split()
    assert rc == "0" and int(waited) >= 0
    log = (logs / "install-third.log").read_text()
    assert "built third (install)" in log and "GB wanted" in log


def test_on_a_roomy_disk_nothing_waits(tmp_path) -> None:
    root = _stubbed(tmp_path, ["first", "second"])
    logs = root / "logs"
    done = subprocess.run(["bash", str(root / ".ci" / "stack-installs"), str(logs), "first", "second"],
                          env={"PATH": "/usr/bin:/bin", "CI_HEADROOM_GB": "0", "CI_DISK_POLL_S": "0.1"},
                          timeout=30, check=True)
    assert done.returncode == 0
    for stack in ("first", "second"):
        rc, _, waited = (logs / f"install-{stack}.rc").read_text().split()
        assert rc == "0" and waited == "0"


def test_a_failed_install_is_recorded_with_the_free_disk(tmp_path) -> None:
    root = _stubbed(tmp_path, ["broken"])
    (root / ".ci" / "broken").write_text("#!/usr/bin/env bash\necho 'No space left on device' >&2\nexit 7\n")
    logs = root / "logs"
    subprocess.run(["bash", str(root / ".ci" / "stack-installs"), str(logs), "broken"],
                   env={"PATH": "/usr/bin:/bin", "CI_HEADROOM_GB": "0"}, timeout=30, check=True)
    assert (logs / "install-broken.rc").read_text().split()[0] == "7"
    assert "disk after the failed install" in (logs / "install-broken.log").read_text()
