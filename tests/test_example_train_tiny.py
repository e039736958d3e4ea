"""examples/train_tiny.py stays runnable: a few steps of both runs, equal losses, a PNG written, by default
where git ignores it (running an example changes no tracked file)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT


def test_train_tiny_example_runs(tmp_path, capsys) -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    threads = torch.get_num_threads()
    try:
        import train_tiny

        assert train_tiny.main(["--steps", "4", "--png", str(tmp_path / "curves.png")]) == 0
    finally:
        torch.set_num_threads(threads)
        sys.path.remove(str(ROOT / "examples"))
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    out = capsys.readouterr().out
    assert "12 patched" in out and "final loss: unpatched" in out


@pytest.mark.skipif(shutil.which("git") is None or not (ROOT / ".git").exists(), reason="not a git checkout")
def test_train_tiny_writes_outside_tracked_files_by_default() -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import train_tiny
    finally:
        sys.path.remove(str(ROOT / "examples"))
    path = train_tiny.DEFAULT_PNG.relative_to(ROOT).as_posix()
    ignored = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, check=False)
    assert ignored.returncode == 0, f"{path} is not ignored by git: the example would write into the checkout"
