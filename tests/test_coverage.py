"""``patch-engine coverage`` on a few types (the full sweep is a command: docs/coverage.md)."""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from engine.commands.cli import main
from engine.commands.coverage import LIGER_MODEL_TYPES, coverage_rows, parameter_share, render_markdown
from engine.tiny import build_tiny_model


@pytest.fixture(scope="module")
def rows():
    return {r.model_type: r for r in coverage_rows(["qwen3", "gemma", "gpt2"], verify=True)}


def test_rows_say_patchsets_verification_and_share(rows) -> None:
    qwen3, gemma, gpt2 = rows["qwen3"], rows["gemma"], rows["gpt2"]
    assert qwen3.patchsets == ["qwen3", "qwen3_flce"] and qwen3.verified is True
    assert "swiglu" in qwen3.patched and "rms_norm" in qwen3.patched
    # Qwen3-8B-sized default config: the MLPs hold most parameters, the embeddings and attention the rest
    assert 0.5 < qwen3.share < 0.9
    # gemma's patchset patches its norms and its GeGLU MLP (the geglu op): most of the model
    assert gemma.verified is True and gemma.share > 0.5 and "geglu" in gemma.patched
    assert gpt2.patchsets == [] and gpt2.verified is None and gpt2.share is None


def test_share_counts_parameters_under_patched_modules_once() -> None:
    model = build_tiny_model("llama", {})
    share, ops = parameter_share(model, "llama")
    mlp = sum(p.numel() for m in model.modules() if type(m).__name__ == "LlamaMLP" for p in m.parameters())
    norms = sum(p.numel() for m in model.modules() if type(m).__name__ == "LlamaRMSNorm" for p in m.parameters())
    total = sum(p.numel() for p in model.parameters())
    assert share == pytest.approx((mlp + norms) / total)
    assert ops == "rms_norm, rope, swiglu"


def test_markdown_has_a_headline_and_one_row_per_type(rows) -> None:
    text = render_markdown(list(rows.values()))
    assert "**2** of 3 model types have a bundled patchset; **2** of the 2 verified pass" in text
    assert "2 of 2 patch more than half of the model" in text
    assert f"Liger-Kernel 0.8.5 patches {len(LIGER_MODEL_TYPES)} model types" in text
    assert "| qwen3 | qwen3, qwen3_flce | yes |" in text
    assert "| gpt2 | - | - | - | - |  |  |" in text
    # covered types come first
    assert text.index("| gemma |") < text.index("| gpt2 |")


def test_cli_writes_the_table(tmp_path: Path) -> None:
    out = tmp_path / "coverage.md"
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        assert main(["coverage", "llama", "gpt2", "--no-verify", "--out", str(out)]) == 0
    text = out.read_text()
    assert "| llama | llama | - |" in text and "| gpt2 |" in text


def test_a_patchset_that_cannot_plan_is_a_row_with_its_reason_and_the_sweep_goes_on(tmp_path: Path) -> None:
    # transformers renames a class (Dots1Experts was Dots1NaiveMoe before 5.13): the patchset no longer plans.
    # The table once stopped at such a row; now the row says why and the next type is still measured.
    broken = tmp_path / "renamed.yaml"
    broken.write_text(
        "name: renamed\nmodel_types: [qwen3]\npatches:\n"
        "  - {target: Qwen3RMSNorm, op: rms_norm, scale: weight}\n"
        "  - {target: Qwen3Experts, op: moe_experts}\n",
        encoding="utf-8",
    )
    rows = coverage_rows(["qwen3", "llama"], verify=True, patchsets={"qwen3": [str(broken)], "llama": ["llama"]})
    qwen3, llama = (next(r for r in rows if r.model_type == t) for t in ("qwen3", "llama"))
    assert qwen3.verified is False and qwen3.share is None
    assert "TargetNotFound" in qwen3.note and "'Qwen3Experts'" in qwen3.note and "renamed.yaml:5" in qwen3.note
    assert llama.verified is True and 0 < llama.share < 1 and llama.patched == "rms_norm, rope, swiglu"
    text = render_markdown(rows)
    assert "| qwen3 | " + str(broken) + " | **no** | - |" in text and "| llama | llama | yes |" in text


def test_the_measured_column_scaffolds_and_verifies_a_type_with_no_bundled_patchset(tmp_path: Path) -> None:
    from engine.commands.coverage_measured import load_measured, measure_types

    data = tmp_path / "measured.json"
    entries = measure_types(["gpt2", "t5gemma2"], data)
    gpt2, t5gemma2 = entries["gpt2"], entries["t5gemma2"]
    # GPT-2's LayerNorms are measured exact and the measured patchset verifies on its tiny model
    assert gpt2["verified"] is True and "layer_norm" in gpt2["ops"] and gpt2["patches"] >= 1
    # T5Gemma 2's tiny model runs on no token ids alone (an encoder-decoder: decoder ids), nor does its
    # decoder alone (no model of its own): the row says why
    assert t5gemma2["verified"] is None and t5gemma2["reason"].startswith("its tiny model does not build")
    assert load_measured(data) == entries  # written after each type: a stopped sweep resumes
    rows = coverage_rows(["gpt2", "t5gemma2", "llama"], verify=False, measured=entries)
    text = render_markdown(rows)
    assert "| gpt2 | measured | yes | - | layer_norm" in text
    assert "| t5gemma2 | measured | - | - | - |  | its tiny model does not build" in text
    # the headline counts the generative types patched and verified, bundled or measured
    assert "**1** of the 3 causal-LM and image-text-to-text types" in text and "1 by declarations the scaffold measured" in text
