"""Coverage's first column counts what a user gets on a composite (issue 47): ``engine.apply(model)`` on
the composite's own class, never its language model standing in for it.

Real tiny composites: BLIP-2 (its forward demands ``pixel_values``; the scaffold alone measures its
OPT language model) is patched and verified whole, and its entry is the composite's apply, judged
here against the unpatched composite's own numbers; PI0 (its forward needs ``action_embeds``, which no
probe makes) is "not patched" with that reason, where its PaliGemma stand-in once made it "yes".
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _row(model_type: str, entry: dict) -> str:
    from engine.commands.coverage import coverage_rows, render_markdown

    text = render_markdown(coverage_rows([model_type], verify=False, patchsets={}, measured={model_type: entry}))
    return next(line for line in text.splitlines() if line.startswith(f"| {model_type} |"))


def _applied_and_trained_like_unpatched(model_type: str, images: str) -> object:
    """The tiny composite a user would hold, apply(model) on it, and its training trajectory (logits, loss, logits
    after one SGD step) judged against the unpatched composite's; returns apply's report."""
    import engine
    from engine.commands.tester_configs import _with_labels, judged, no_dropout, trajectory
    from engine.tiny import build_tiny_model
    from engine.tiny.config import derive_tiny_config
    from engine.verification.probes import probe_batch

    model = build_tiny_model(model_type, derive_tiny_config(model_type), seed=0, check_size=True)
    no_dropout(model.config, model)
    inputs = probe_batch(model)
    assert images in inputs and "labels" in inputs
    train, _ = _with_labels(model, inputs)
    want = trajectory(copy.deepcopy(model), inputs, train)
    report = engine.apply(model)
    try:
        assert engine.verify(model, raise_on_failure=False, conditions=None).passed
        got = trajectory(model, inputs, train)
    finally:
        engine.revert(model)
    for key in want:
        ok, note = judged(got[key], want[key], None)
        assert ok, f"{key}: {note}"
    return report


def test_blip2s_entry_is_the_composites_own_apply_judged_against_the_unpatched_composite() -> None:
    from engine.commands.coverage_measured import measure_type
    from engine.tiny.subject import tiny_subject

    assert tiny_subject("blip-2").tiny_type == "opt"  # the scaffold's stand-in, unchanged (patchsets use it)
    entry = measure_type("blip-2")
    assert entry["class"] == "Blip2ForConditionalGeneration" and "tiny_type" not in entry
    assert entry["verified"] is True and entry["ops"] == "layer_norm, mlp"  # OPT alone: layer_norm only
    assert "language model" not in entry.get("note", "")
    # the same model a user would hold, apply(model), against the unpatched composite's numbers
    report = _applied_and_trained_like_unpatched("blip-2", "pixel_values")
    assert len(report.patched) == entry["patches"]
    assert ", ".join(sorted({d.op for d in report.decisions if d.action == "patch"})) == entry["ops"]
    assert _row("blip-2", entry).startswith("| blip-2 | measured | yes | - | layer_norm, mlp |")


@pytest.mark.parametrize(("model_type", "images", "ops"), [
    ("pix2struct", "flattened_patches", "rms_norm"),
    ("pp_formulanet", "pixel_values", "layer_norm, mlp"),
])
def test_an_image_to_text_encoder_decoder_is_patched_whole_on_its_images(model_type: str, images: str,
                                                                         ops: str) -> None:
    """Pix2Struct and PP-FormulaNet run on images only in their encoder (flattened patches, pixels): the probe draws
    them, so apply(model) on the composite patches its modules, and training it matches the unpatched composite."""
    report = _applied_and_trained_like_unpatched(model_type, images)
    assert ", ".join(sorted({d.op for d in report.decisions if d.action == "patch"})) == ops


def test_pi0_is_not_patched_with_its_reason_not_its_language_models_yes() -> None:
    import engine
    from engine.commands.coverage_measured import measure_type
    from engine.tiny import build_tiny_model
    from engine.tiny.config import derive_tiny_config

    entry = measure_type("pi0")
    assert entry["verified"] is None and entry["patches"] == 0 and entry["ops"] == ""
    assert entry["reason"].startswith("not patched: engine.apply(model) patched nothing on PI0Model")
    assert "action_embeds" in entry["reason"]
    model = build_tiny_model("pi0", derive_tiny_config("pi0"), seed=0, check_size=True)
    with pytest.warns(Warning):
        assert not engine.apply(model).patched  # what the entry says
    row = _row("pi0", entry)
    assert row.startswith("| pi0 | measured | - | - | - |  | not patched: ")


def test_the_committed_column_has_no_stand_in_left() -> None:
    data = json.loads((ROOT / "benchmarks/results/coverage_measured.json").read_text(encoding="utf-8"))["types"]
    stand_ins = [t for t, e in data.items() if "tiny_type" in e or "on its language model" in e.get("note", "")]
    assert stand_ins == []
    for name in ("blip", "blip-2", "instructblip", "instructblipvideo", "kosmos-2"):
        assert data[name]["verified"] is True and "mlp" in data[name]["ops"], name
    page = (ROOT / "docs/coverage.md").read_text(encoding="utf-8")
    assert "measured on its language model" not in page
