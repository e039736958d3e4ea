"""The accelerator benchmark harness (benchmarks/run.py --device cuda) in its CPU dry run.

The dry run is the same code at tiny sizes: every variant that can run on a CPU runs (the
unpatched model, ours with verification on, the MoE variants) and the ones that need CUDA
(Liger's Triton kernels) are reported as skipped with the reason, so the harness is known to
work before GPU time is spent on it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_dry_run_measures_every_cpu_variant_and_skips_cuda_ones(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--dry-run", "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "dry-run.json").read_text())
    train = {r["variant"]: r for r in results["train"]}
    assert set(train) == {"hf eager", "liger", "ours"}
    for name in ("hf eager", "ours"):
        assert math.isfinite(train[name]["step_ms"]) and train[name]["step_ms"] > 0
    assert train["ours"]["verified"] is True
    assert any(k.startswith("fused_linear_cross_entropy:") for k in train["ours"]["kernels"])
    assert abs(train["ours"]["loss"] - train["hf eager"]["loss"]) < 1e-4  # same weights, same batch
    assert "CUDA" in train["liger"]["skipped"] or "not installed" in train["liger"]["skipped"]
    moe = {r["variant"]: r for r in results["moe"]}
    assert {"eager", "hf default (grouped_mm)", "ours (grouped_mm)"} <= set(moe)
    assert moe["ours (grouped_mm)"]["out_max_abs_err"] == 0.0  # the eager loop's sums, bf16
    assert "skipped" in moe["ours (liger)"]
    markdown = (tmp_path / "dry-run.md").read_text()
    assert "| ours |" in markdown and f"| liger | - | - | - | - | - | {train['liger']['skipped']} |" in markdown


def test_cuda_without_a_gpu_says_how_to_dry_run(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "run.py"), "--device", "cuda",
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=300, check=False)
    assert proc.returncode == 2 and "--dry-run" in proc.stderr
    assert not list(tmp_path.iterdir())
