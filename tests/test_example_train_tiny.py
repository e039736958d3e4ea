"""examples/train_tiny.py stays runnable: a few steps of both runs, equal losses, a PNG written."""

from __future__ import annotations

import sys

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
