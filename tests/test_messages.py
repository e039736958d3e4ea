"""Messages a newcomer reads right (issue 38, item 5).

``validate`` said ``ok`` for a file whose norms were flipped (it checks the schema, not the
numbers); the verify table showed swiglu ``bf16 rel 3.6e+01`` marked ok (the judge that passed
it looks at the original's own rounding error, not at relative errors of near-zero elements);
a failing bf16 check said "shape or dtype differs" beside a numeric error; rows said
``compiled`` where the torch reference ran. Each text is asserted here, against real numbers
where it is about numbers.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.commands.cli import main
from engine.kernels import compiled
from engine.verification.compare import FLOOR_ULPS, NOISE_FACTOR, allowed, judge, max_abs, max_abs_diff
from engine.verification.modules import ran_kernel
from engine.verification.results import Check, VerifyReport

ROOT = Path(__file__).resolve().parent.parent
QWEN3 = ROOT / "patchsets" / "qwen3.yaml"


def test_validate_says_it_checked_the_schema_and_what_checks_the_rest(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(QWEN3)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == f"{QWEN3}: ok (qwen3, 3 patches)"  # stdout stays one line per file
    assert "validate checked the schema only" in err
    assert f"(patch-engine plan {QWEN3})" in err and f"(patch-engine verify {QWEN3})" in err
    assert main(["validate", "--json", str(QWEN3)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["checked"] == "schema" and data["not_checked"] == {"targets": "plan", "numbers": "verify"}


def test_the_commands_validate_suggests_run_as_printed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A user's file in a folder with a space, validated from elsewhere: the suggested plan command runs."""
    folder = tmp_path / "my patchsets"
    folder.mkdir()
    mine = folder / "mine.yaml"
    mine.write_text(QWEN3.read_text(encoding="utf-8"), encoding="utf-8")
    assert main(["validate", str(mine)]) == 0
    err = capsys.readouterr().err
    command = err.split("(patch-engine plan ", 1)[1].split(")", 1)[0]
    assert shlex.split(command) == [str(mine)]
    done = subprocess.run(["bash", "-c", f"cd / && {shlex.quote(sys.executable)} -m engine plan {command} --device cpu"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Qwen3RMSNorm" in done.stdout


def _bf16_swiglu_like() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An original bf16 result, its fp64 truth, and a correct kernel's result rounded otherwise (some elements near 0)."""
    gen = torch.Generator().manual_seed(0)
    truth = torch.randn(64, 32, generator=gen, dtype=torch.float64)
    truth[0, 0] = 1e-4  # near zero: a huge relative error for an ordinary rounding difference
    original = truth.to(torch.bfloat16)
    got = (truth * (1 + 2e-3)).to(torch.bfloat16)
    got[0, 0] = torch.tensor(5e-3, dtype=torch.bfloat16)
    return got, original, truth


def test_the_table_shows_the_bound_of_the_judge_that_passed_a_check_not_a_relative_error() -> None:
    got, original, truth = _bf16_swiglu_like()
    verdict = judge(got, original, truth)
    passed, note = verdict
    diff = max_abs_diff(got, original)
    assert passed and verdict.limit == pytest.approx(NOISE_FACTOR * max_abs_diff(original, truth)
                                                     + FLOOR_ULPS * (allowed(0.0, max_abs(truth), torch.bfloat16)))
    rel = float(((got.double() - original.double()).abs() / original.double().abs().clamp_min(1e-12)).max())
    assert rel > 10  # what the table used to show beside "ok"
    report = VerifyReport(checks=[
        Check("model.layers.0.mlp", "Qwen3MLP", "swiglu", "declaration", "fp32", 0.0, 0.0, True, "", "compiled"),
        Check("model.layers.0.mlp", "Qwen3MLP", "swiglu", "kernel", "fp32", 0.0, 0.0, True, "", "torch"),
        Check("model.layers.0.mlp", "Qwen3MLP", "swiglu", "kernel", "bf16", diff, rel, passed, note, "compiled",
              limit=verdict.limit),
    ])
    table = report.table().splitlines()
    assert table[0].split() == ["module", "class", "op", "kernel", "fp32", "diff", "/", "allowed", "bf16", "diff",
                                "/", "allowed", "result", "note"]
    row = table[2].split()
    assert row[3:7] == ["compiled", "(fp32:", "torch)", "0"]  # what ran in each dtype
    assert row[7:10] == [f"{diff:.1e}", "/", f"{verdict.limit:.1e}"] and diff <= verdict.limit and row[10] == "ok"
    assert f"{rel:.1e}" not in table[2]
    data = report.to_dict()["modules"][0]
    assert data["errors"]["bf16"]["allowed"] == verdict.limit and "allowed" not in data["errors"]["fp32"]


def test_a_failure_not_counted_is_not_marked_plain_ok() -> None:
    report = VerifyReport(checks=[
        Check("m", "Norm", "rms_norm", "kernel", "fp32", 0.0, 0.0, True, "", "liger"),
        Check("m", "Norm", "rms_norm", "kernel", "bf16", 0.5, 1.0, True, "not counted (the model is fp32): measured",
              "liger", counted=False),
    ])
    row = report.table().splitlines()[2]
    assert "ok (bf16 not counted)" in row and "not counted (the model is fp32)" in row and "5.0e-01" in row


@pytest.mark.parametrize("kind", ["dtype", "shape"])
def test_a_note_names_what_really_differs(kind: str) -> None:
    truth = torch.randn(4, 8, dtype=torch.float64)
    original = truth.to(torch.bfloat16)
    got = original.float() if kind == "dtype" else original[:, :4]
    passed, note = judge(got, original, truth)
    assert not passed and "shape or dtype" not in note
    expected = "the patched result is fp32 where the original's is bf16" if kind == "dtype" else \
        "the patched result has shape (4, 4), the original's (4, 8)"
    assert note.startswith(expected)


def test_a_compiled_kernel_that_does_not_compile_in_a_dtype_is_shown_as_torch() -> None:
    rule = compiled.rule().get("rms_norm", {})
    decision = SimpleNamespace(kernel="compiled", op="rms_norm")
    assert rule.get((torch.float32, False)) is None and ran_kernel(decision, torch.float32) == "torch"
    if rule.get((torch.bfloat16, False)) is not None:
        assert ran_kernel(decision, torch.bfloat16) == "compiled"
    assert ran_kernel(SimpleNamespace(kernel="liger", op="rms_norm"), torch.float32) == "liger"


def test_a_wrong_declaration_shows_the_bit_exact_bound_it_failed() -> None:
    """The flipped norm (``one_plus_weight``): its declaration check allows 0 (``scale: weight`` fits exactly)."""
    import engine
    from engine.loader import load_patchset
    from engine.tiny import build_tiny_model

    data = load_patchset("qwen3").model_dump(mode="json", exclude_none=True)
    data["patches"][0]["scale"] = "one_plus_weight"
    for patch in data["patches"]:
        patch["kernel"] = "torch"
    model = build_tiny_model("qwen3", dict(load_patchset("qwen3").tiny_model.config))
    report = engine.verify(model, data, device="cpu", raise_on_failure=False)
    row = next(line for line in report.table().splitlines() if line.startswith("model.norm "))
    cells = row.split()
    assert cells[4:7] == [cells[4], "/", "0"] and float(cells[4]) > 1 and "FAIL" in cells
    assert "scale: weight fits" in row
