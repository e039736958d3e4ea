"""The CLI a person reads and a machine parses: tables, --json, exit codes 0 / 1 / 2; the pre-commit hook."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from engine.commands.cli import main
from engine.loader import bundled_dir

REPO = Path(__file__).resolve().parent.parent


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_verify_prints_the_per_module_table(capsys) -> None:
    code, out, _ = run(capsys, "verify", "qwen3.yaml", "--model-type", "qwen3")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"verify 'qwen3' from {bundled_dir() / 'qwen3.yaml'} on a tiny qwen3 (Qwen3ForCausalLM, cpu)"
    assert lines[1].startswith("verification passed: 12 patched modules and functions")
    # grouped by class, op and kernel (within 120 columns: engine.commands.verify_table); bit-equal in both dtypes
    assert "Qwen3RMSNorm: rms_norm, kernel torch; 9 modules" in lines
    assert re.match(r"  model\.norm +0 +0 +ok$", lines[13]), out


def test_verify_json(capsys) -> None:
    code, out, _ = run(capsys, "verify", "qwen3", "--json")
    data = json.loads(out)
    assert code == 0 and data["ok"] is True and data["patchset"] == "qwen3" and data["model_type"] == "qwen3"
    assert {m["module"] for m in data["modules"]} >= {"model.norm", "<model> logits", "<model> grads"}


def test_verify_failure_exits_1(capsys, tmp_path: Path) -> None:
    text = (REPO / "patchsets" / "qwen3.yaml").read_text().replace("scale: weight", "scale: one_plus_weight")
    path = tmp_path / "wrong.yaml"
    path.write_text(text)
    code, out, _ = run(capsys, "verify", str(path))
    assert code == 1
    assert out.splitlines()[1].startswith("verification FAILED (")
    # the note beneath its row: the table fits 120 columns
    assert re.search(r"FAIL\n +note: declared scale: one_plus_weight, cast: llama does not reproduce", out), out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["verify", "qwen3", "--model-type", "qwen33"], "usage error: unknown model type 'qwen33'"),
        (["plan", "qwen3", "--device", "tpu"], "usage error: unknown device 'tpu'"),
        (["verify", "qwen3", "--bogus"], "unrecognized arguments: --bogus"),
        (["nosuchcommand"], "invalid choice"),
    ],
)
def test_usage_errors_exit_2(capsys, argv: list[str], message: str) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2 and message in err


def test_refusals_exit_1_and_json_says_why(capsys) -> None:
    code, out, err = run(capsys, "plan", "qwen3", "--model-type", "llama", "--json")
    assert code == 1 and err.startswith("error: patchset 'qwen3' is for model_type qwen3")
    assert json.loads(out) == {"ok": False, "type": "ModelTypeMismatch", "error": err.removeprefix("error: ").strip()}


def test_validate_exit_codes_and_json(capsys, tmp_path: Path) -> None:
    good = str(REPO / "patchsets" / "qwen3.yaml")
    assert run(capsys, "validate", good)[0] == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodel_types: [qwen3]\npatches:\n  - target: A\n    op: rms_norm\n    scael: weight\n")
    code, out, err = run(capsys, "validate", good, str(bad))
    assert code == 1 and f"{bad}:6: patches[0].scael: unknown key 'scael'; did you mean 'scale'?" in err
    code, out, _ = run(capsys, "validate", "--json", good, str(bad))
    data = json.loads(out)
    assert code == 1 and data["ok"] is False
    assert data["files"][0] == {"file": good, "ok": True, "name": "qwen3", "patches": 3}
    first = data["files"][1]["errors"][0]
    assert (first["file"], first["line"], first["key"]) == (str(bad), 4, "patches[0]")


def test_plan_table(capsys) -> None:
    code, out, _ = run(capsys, "plan", "qwen3", "--detail")
    assert code == 0
    lines = out.splitlines()
    assert lines[1].startswith("verification: none needed, bundled content 'qwen3'")  # how apply would verify it
    header = lines[2].split()
    assert header == ["module", "class", "op", "kernel", "decision", "why"]


def test_pre_commit_hook_declares_validate() -> None:
    hooks = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())
    (hook,) = [h for h in hooks if h["id"] == "patch-engine-validate"]
    assert hook["language"] == "python"
    assert shlex.split(hook["entry"])[:2] == ["patch-engine", "validate"]
    files = re.compile(hook["files"])
    assert files.search("patchsets/qwen3.yaml") and files.search("models/patchsets/mine.yml")
    assert not files.search("README.md") and not files.search("config/qwen3.yaml")
    # the entry, as pre-commit runs it (entry + file names), succeeds on the bundled patchsets
    names = [str(p) for p in sorted((REPO / "patchsets").glob("*.yaml"))]
    assert main(shlex.split(hook["entry"])[1:] + names) == 0
