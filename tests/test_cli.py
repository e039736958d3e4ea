"""The command line: validate's exit codes and file:line output, schema, plan, verify, demo."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.commands.cli import main
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


# `verify PATCHSET --model PATH | --gguf FILE`: what a user typed is checked before anything loads
# (tests/test_real_checkpoints.py runs it on two real checkpoints).


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--gguf", "no/such/model.gguf"], "--gguf no/such/model.gguf: no such file"),
        (["--model", "no/such/folder"], "--model no/such/folder: no such folder"),
        (["--model", "{tmp}"], "no config.json in this folder"),
        (["--model", "{tmp}", "--gguf", "{tmp}/x.gguf"], "give --model PATH or --gguf FILE, not both"),
        (["--model", "{tmp}", "--model-type", "llama"], "--model-type builds a tiny model"),
        (["--model", "{tmp}", "--text", "no/such.txt"], "--text no/such.txt: no such file"),
        (["--model", "{tmp}", "--max-tokens", "1"], "--max-tokens 1: verification needs at least 2 tokens"),
        (["--text", "no/such.txt"], "--text apply to a checkpoint only: add --model PATH or --gguf FILE"),
        (["--mode", "training"], "--mode apply to a checkpoint only"),
    ],
    ids=["gguf-missing", "folder-missing", "not-a-checkpoint", "both", "model-type", "text-missing", "max-tokens",
         "text-without-checkpoint", "mode-without-checkpoint"],
)
def test_verify_checkpoint_usage_errors_exit_2(argv: list[str], message: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    assert main(["verify", "llama", *argv]) == 2
    assert message.replace("{tmp}", str(tmp_path)) in capsys.readouterr().err


def test_verify_gguf_without_the_gguf_package_names_the_extra(tmp_path: Path) -> None:
    """A fresh process in which `import gguf` fails, as where the package is not installed."""
    blocker = (
        "import sys\n"
        "class _NoGguf:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'gguf':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}')\n"
        "sys.meta_path.insert(0, _NoGguf())\n"
        "from engine.commands.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    proc = subprocess.run([sys.executable, "-c", blocker, "verify", "llama", "--gguf", str(model)],
                          check=False, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert "loading model.gguf needs the gguf package, which is not installed; " in proc.stderr
    assert 'pip install "patch-engine[gguf]"' in proc.stderr
