"""The benchmark script runs and writes its JSON and chart (a smoke run; no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from engine.cli import main


def test_bench_cli_writes_results(tmp_path: Path) -> None:
    assert main(["bench", "--only", "overhead,plan", "--repeats", "1", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "cpu.json").read_text())
    assert results["plan"]["modules_patched"] == 64 * 4 + 1 + 64 + 1  # 4 norms/layer, final norm, MLPs, rope
    assert results["overhead"]["direct_us"] > 0
    assert (tmp_path / "cpu.png").stat().st_size > 0
