"""Composite (multimodal) models: one patchset for the language model and the vision tower.

The text path (logits, loss, every gradient) is covered for every bundled patchset by
tests/test_families.py; here: the tiny composite model builds from text_config /
vision_config, the plan says which sub-model each decision belongs to, and the vision
tower's output and gradients on random pixels are equal patched vs unpatched (fp32 and
bf16, bit for bit with the torch reference kernels).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_for

import engine
from engine.loader import bundled_names, load_patchset
from engine.tiny import build_tiny_model, image_features, tiny_vision_inputs


def _composite_names() -> list[str]:
    names = []
    for name in bundled_names():
        tiny = load_patchset(name).tiny_model
        if tiny is not None and "vision_config" in tiny.config:
            names.append(name)
    return names


COMPOSITES = _composite_names()
#: Composite patchsets whose vision tower is not probed with pixels here, and why.
NO_PIXEL_PROBE = {"gemma4": "its tower takes patches with 2-D position ids; no vision patch is declared",
                  "muse_glimmer": "its tower takes temporal patches the probe does not build; no vision patch is declared",
                  "llava_next": "any-resolution 5-D pixels with image_sizes, which the probe does not build; text only",
                  "llava_onevision": "any-resolution 5-D pixels with image_sizes, which the probe does not build; text only",
                  "lfm2_vl": "SigLIP2 NaFlex patches with their masks, which the probe does not build; text only"}


def test_composites_are_bundled() -> None:
    expected = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "paligemma", "gemma3", "internvl", "mllama"}
    assert expected <= set(COMPOSITES)


def test_tiny_composite_takes_text_and_vision_configs() -> None:
    model = build_tiny_model("llava", {
        "text_config": {"model_type": "llama", "num_hidden_layers": 1, "pad_token_id": 0},
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                          "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 16, "patch_size": 4},
    })
    text, vision = model.config.text_config, model.config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.vocab_size) == (64, 1, 256)  # base sizes + override
    assert (vision.hidden_size, vision.image_size) == (32, 16)
    assert type(model).__name__ == "LlavaForConditionalGeneration"
    assert sum(p.numel() for p in model.parameters()) < 200_000


def test_plan_shows_the_sub_model_of_each_decision() -> None:
    model = tiny_for("qwen2_vl")
    plan = engine.plan(model, "qwen2_vl", device="cpu")
    owners = {(d.cls if d.site is None else d.path.rsplit(".", 1)[-1]): d.sub_model for d in plan.decisions}
    assert owners["Qwen2VLRMSNorm"] == "model.language_model"
    assert owners["LayerNorm"] == "model.visual"
    assert owners["apply_rotary_pos_emb_vision"] == "model.visual"
    assert owners["apply_rotary_pos_emb"] == "model.language_model"
    table = str(plan)
    header = next(line for line in table.splitlines() if line.startswith(("sub-model", "target")))  # after the notes
    assert header.startswith("sub-model") and "model.visual" in table
    assert "sub-model" not in str(engine.plan(tiny_for("qwen3"), "qwen3", device="cpu"))  # not for plain LMs


@pytest.mark.parametrize("name", [n for n in COMPOSITES if n not in NO_PIXEL_PROBE])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_vision_tower_patched_equals_unpatched(name: str, dtype: torch.dtype) -> None:
    reference = tiny_for(name, dtype=dtype)
    patched = copy.deepcopy(reference)
    report = engine.apply(patched, name, device="cpu")
    vision = [d for d in report.decisions if d.action == "patch" and "lang" not in d.sub_model
              and d.sub_model not in ("", "<root>", "model")]
    assert vision, "the patchset patches nothing in the vision tower"
    inputs = tiny_vision_inputs(reference)

    def run(model):
        model.zero_grad(set_to_none=True)
        feats = image_features(model, inputs)
        feats.float().pow(2).mean().backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        return feats.detach(), grads

    with engine.torch_path(reference):
        want, want_grads = run(reference)
    got, got_grads = run(patched)
    assert torch.equal(got, want)
    assert want_grads and got_grads.keys() == want_grads.keys()
    for k in want_grads:
        assert torch.equal(got_grads[k], want_grads[k]), k


def test_llama4_composite_verifies_its_vision_tower_from_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    """``patch-engine verify llama4`` on the composite: its tower's adapter gets the width its pixel shuffle makes.

    Regression (issue 47): the derived tiny config shrank the vision width (32, shuffled by 0.5 to 128)
    and the adapter MLP's ``intermediate_size`` (64) apart, and the vision probe died in a raw
    ``mat1 and mat2 shapes cannot be multiplied (4x128 and 64x4096)``.
    """
    import json

    from engine.commands.cli import main

    model = build_tiny_model("llama4")
    feats = image_features(model, tiny_vision_inputs(model))  # 4 x 4 patches shuffled to 2 x 2, projected
    assert feats.shape == (1, 4, model.config.text_config.hidden_size)
    assert main(["verify", "llama4", "--model-type", "llama4", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["ok"] and row["model"] == "Llama4ForConditionalGeneration"
    checked = {m["module"] for m in row["modules"] if m["passed"]}
    assert "vision_model.model.layers.0.input_layernorm" in checked
    assert any(m.endswith("modeling_llama4.vision_apply_rotary_emb") for m in checked)
    assert sum(p.numel() for p in model.parameters()) < 300_000  # the defaults' 4096-wide adapter: 17M


def test_zero_configuration_patches_mistral3_whole_with_the_rope_of_both_modules() -> None:
    """``engine.apply(model)`` on a Mistral 3 composite: its language model, its Pixtral tower and projector,
    and ``apply_rotary_pos_emb`` in both modules that define it (modeling_mistral for the text,
    modeling_pixtral for the images: the scaffold now runs the tower, so both copies are measured where they
    are called; issue 47). Image features and logits are the unpatched model's, bit for bit."""
    model = build_tiny_model("mistral3")
    unpatched = copy.deepcopy(model)
    report = engine.apply(model)
    patched = [d for d in report.decisions if d.action == "patch"]
    ropes = {d.path.rsplit(".", 2)[-2] for d in patched if d.op == "rope"}
    assert ropes == {"modeling_mistral", "modeling_pixtral"}, ropes
    classes = {d.cls for d in patched}
    assert {"PixtralRMSNorm", "PixtralMLP", "Mistral3RMSNorm", "MistralRMSNorm", "MistralMLP"} <= classes
    inputs = tiny_vision_inputs(model)
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(image_features(model, inputs), image_features(unpatched, inputs))
        assert torch.equal(model(input_ids=ids).logits, unpatched(input_ids=ids).logits)


#: Composites whose forward cannot run on token ids alone, and the inputs the probe gives them
#: (engine.tiny.vision_inputs.query_token_inputs): images, with query tokens at an image token (BLIP-2,
#: InstructBLIP: a Q-Former instruction too), at a video token (InstructBLIP-Video, frames), where a
#: position mask says (Kosmos-2), or none (BLIP: cross-attention). pix2struct, pp_formulanet (encoder-decoders
#: over patches) and pi0 (state and actions) are not among them yet: apply(model) still measures nothing there.
NEEDS_IMAGES = ["blip", "blip-2", "instructblip", "instructblipvideo", "kosmos-2"]


@pytest.mark.parametrize("model_type", NEEDS_IMAGES)
def test_zero_configuration_patches_a_composite_that_needs_images(model_type: str) -> None:
    """``engine.apply(model)`` on the composite itself (issue 47: it patched nothing, the probe gave no images):
    its vision tower is patched, and the whole model on the probe's images and ids is the unpatched one's."""
    from engine.verification.probes import probe_batch

    model = build_tiny_model(model_type)
    unpatched = copy.deepcopy(model)
    report = engine.apply(model)
    patched = [d for d in report.decisions if d.action == "patch"]
    assert any("vision" in d.sub_model or "vision" in d.path for d in patched), str(report)
    batch = probe_batch(model)
    assert "pixel_values" in batch
    model.eval(), unpatched.eval()  # dropout off: the two runs draw no masks
    with torch.no_grad():
        got, want = model(**batch), unpatched(**batch)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)
