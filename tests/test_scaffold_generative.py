"""`patch-engine scaffold TYPE` works from a type's config alone, for the types issue 41 found failing.

Each failed before: mistral3 ("no causal-LM class"), granitemoehybrid and jamba (`get_mask_sizes`
can only be called on Attention layers: a hybrid cache), gemma3n (asks for timm; its tiny config
did not build), aya_vision (`embed_dim` 1152 not divisible by 14 heads), minicpm3 (a shape
mismatch), lfm2_moe (`NoneType` is not subscriptable); cohere2's LayerNorm and rope went unfound.
Each scaffolds now and measures declarations that are exact on the type's tiny model.
"""

from __future__ import annotations

import io
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import yaml

from engine.commands.cli import main
from engine.scaffolding import scaffold

#: model type -> {class or function: op} that its scaffold must declare (measured exact, fp32 and bf16).
EXPECTED = {
    "mistral3": {"MistralRMSNorm": "rms_norm", "MistralMLP": "swiglu"},
    "granitemoehybrid": {"GraniteMoeHybridRMSNorm": "rms_norm", "GraniteMoeHybridMLP": "swiglu",
                         "GraniteMoeHybridRMSNormGated": "gated_rms_norm"},
    "jamba": {"JambaRMSNorm": "rms_norm", "JambaMLP": "swiglu", "JambaExperts": "moe_experts"},
    "aya_vision": {"Cohere2LayerNorm": "layer_norm", "Cohere2MLP": "swiglu", "function:apply_rotary_pos_emb": "rope"},
    "minicpm3": {"MiniCPM3RMSNorm": "rms_norm", "MiniCPM3MLP": "swiglu", "function:apply_rotary_pos_emb": "rope"},
    "lfm2_moe": {"Lfm2MoeRMSNorm": "rms_norm", "Lfm2MoeExperts": "moe_experts", "function:apply_rotary_pos_emb": "rope"},
    # Cohere's LayerNorm is mean-centred without a bias: the layer_norm op's bias-free form measures it
    "cohere2": {"Cohere2LayerNorm": "layer_norm", "Cohere2MLP": "swiglu", "function:apply_rotary_pos_emb": "rope"},
}


def _declared(result) -> dict[str, str]:
    return {getattr(p, "target", None) or f"function:{p.function}": p.op for p in result.patches}


@pytest.mark.parametrize("model_type", sorted(EXPECTED))
def test_the_scaffold_measures_a_type_that_failed_before(model_type: str) -> None:
    result = scaffold(model_type)
    declared = _declared(result)
    assert {k: declared.get(k) for k in EXPECTED[model_type]} == EXPECTED[model_type]
    text = result.to_yaml()
    data = yaml.safe_load(text)
    assert data["model_types"][0] == model_type and data["tiny_model"]["config"]


def test_gemma3n_scaffolds_without_timm_on_its_language_model() -> None:
    # Gemma 3n's vision tower is timm's (TimmWrapperModel). Without timm the composite cannot be built,
    # so its language model (gemma3n_text, the classes the composite holds) is measured, and the file says so.
    try:
        import timm  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("timm is installed: the composite itself is measured")
    result = scaffold("gemma3n")
    text = result.to_yaml()
    assert result.tiny_type == "gemma3n_text"
    assert "# gemma3n: measured on its language model (gemma3n_text)" in text and "[vision] extra" in text
    data = yaml.safe_load(text)
    assert data["model_types"] == ["gemma3n", "gemma3n_text"] and data["tiny_model"]["model_type"] == "gemma3n_text"
    # every norm, MLP and rope it holds gets a line: measured, or why not
    for name in ("Gemma3nRMSNorm", "Gemma3nTextMLP", "apply_rotary_pos_emb"):
        assert name in text


@pytest.mark.parametrize("model_type", ["mistral3", "gemma3n"])
def test_a_scaffolded_composite_validates_and_verifies_as_written(model_type: str, tmp_path: Path) -> None:
    path = tmp_path / f"{model_type}.yaml"
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        assert main(["scaffold", model_type, "--out", str(path)]) == 0, err.getvalue()
        assert main(["validate", str(path)]) == 0, err.getvalue()
        data = yaml.safe_load(path.read_text())
        if data["patches"]:
            # measured on its language model (gemma3n without timm): the composite cannot be built here to verify
            # on, so the file is verified on the type it was measured on
            measured_on = data["tiny_model"].get("model_type")
            on = ["--model-type", measured_on] if measured_on and measured_on != model_type else []
            assert main(["verify", str(path), *on, "--json"]) == 0, out.getvalue()[-2000:]


def test_a_function_defined_in_two_modules_is_measured_where_each_is_called() -> None:
    # Mistral 3: apply_rotary_pos_emb is defined in modeling_mistral (the language model) and modeling_pixtral
    # (the vision tower, which token ids never reach). A function patch routes the name in both, so the
    # scaffold runs the tower on random images too and measures each copy on its own inputs (issue 47).
    result = scaffold("mistral3")
    rope = next(f for f in result.findings if f.kind == "function" and f.name == "apply_rotary_pos_emb")
    assert rope.instances == 2 and not rope.note and rope.chosen is not None and rope.chosen.patch.op == "rope"
    declared = _declared(result)
    assert declared.get("function:apply_rotary_pos_emb") == "rope"
    assert declared.get("PixtralRMSNorm") == "rms_norm"  # the tower's own modules are measured too
    assert "never calls the one in" not in result.to_yaml()
