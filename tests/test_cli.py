"""The command line: validate's exit codes and file:line output, schema, plan, verify, demo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import main
from engine.loader import bundled_dir, json_schema

ROOT = Path(__file__).resolve().parent.parent


def test_validate_bundled_patchsets_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    files = sorted(str(p) for p in bundled_dir().glob("*.yaml"))
    assert main(["validate", *files]) == 0
    out = capsys.readouterr().out
    assert out.count(": ok (") == len(files)


def test_validate_bad_file_exit_1_with_file_and_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nmodel_types: [qwen3]\npatches:\n  - target: Qwen3RMSNorm\n    op: rms_norm\n"
                   "    scale: one_plus_weigth\n")
    good = bundled_dir() / "qwen3.yaml"
    assert main(["validate", str(good), str(bad)]) == 1
    err = capsys.readouterr().err
    assert f"{bad}:6: patches[0].scale: 'one_plus_weigth' is not one of 'weight', 'one_plus_weight'" in err


def test_usage_error_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate"]) == 2
    assert main(["no-such-command"]) == 2


def test_schema_command_prints_the_committed_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["schema"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json_schema()
    assert printed == json.loads((ROOT / "schemas" / "patchset.schema.json").read_text())


def test_plan_for_cuda_on_a_cpu_machine(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "qwen3.yaml", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "on cuda (training)" in out
    assert "Qwen3RMSNorm" in out and "Qwen3MLP" in out and "apply_rotary_pos_emb" in out


def test_plan_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "qwen3", "--device", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["device"] == "cpu"
    assert {d["class"] for d in data["decisions"]} == {"Qwen3RMSNorm", "Qwen3MLP", "function"}


def test_python_dash_m_engine_and_demo_run() -> None:
    """`python -m engine demo`: the main job end to end in a fresh process, numbers equal."""
    proc = subprocess.run([sys.executable, "-m", "engine", "demo", "--steps", "1"], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "numbers match" in proc.stdout
    assert "logits max |diff|: 0.000e+00" in proc.stdout
