"""A tiny model of every generative type: a sample at every landing, the full sweep as committed data.

``engine.tiny.build_tiny_model(TYPE)`` builds every causal-LM and image-text-to-text type of the
installed transformers from its config alone (defaults shrunk by rule, plus engine/tiny/types.yaml).
The sample below touches each kind of config the rules handle: plain causal LMs, composites
(Aya Vision's SigLIP whose default does not divide, Mistral 3 with no causal-LM class), hybrid
caches (Granite 4, Jamba, Bamba), per-layer inputs and per-layer sizes (Gemma 3n), multimodal rope
sections (Qwen2-VL), BART's decoder, and composites that do not run on token ids (BLIP-2: its
language model stands in; Gemma 3n without timm). The full sweep is
``benchmarks/tiny_every_type.py``; its results (benchmarks/results/tiny_every_type.json) are
checked here to name every type of the installed release.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.errors import InvalidArgument
from engine.tiny import MAX_TINY_PARAMETERS, build_tiny_model
from engine.tiny.config import derive_tiny_config, generative_types, type_overrides
from engine.tiny.subject import tiny_subject

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "tiny_every_type.json"

#: One or two types per kind of config the rules handle (see the module docstring).
SAMPLE = ["llama", "bart", "codegen", "aya_vision", "mistral3", "granitemoehybrid", "jamba", "bamba",
          "gemma3n_text", "qwen2_vl", "lfm2_moe", "minicpm3", "blip-2"]


def _ids(model: torch.nn.Module) -> torch.Tensor:
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return torch.randint(0, min(int(text.vocab_size), 200), (1, 8), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("model_type", SAMPLE)
def test_the_tiny_model_of_a_type_builds_from_its_config_alone_and_runs(model_type: str) -> None:
    subject = tiny_subject(model_type)
    model = subject.model
    count = sum(p.numel() for p in model.parameters())
    assert 0 < count < MAX_TINY_PARAMETERS
    with torch.no_grad():
        out = model(input_ids=_ids(model))
    logits = getattr(out, "logits", None)
    assert logits is not None and torch.isfinite(logits).all()
    # weights perturbed as every tiny model's: a norm weight is never left at exactly one
    norms = [m.weight for m in model.modules() if "Norm" in type(m).__name__ and isinstance(getattr(m, "weight", None), torch.Tensor)]
    assert norms and all((w != 1).all() for w in norms)


def test_a_composite_is_built_whole_where_it_runs_on_token_ids() -> None:
    subject = tiny_subject("mistral3")  # no causal-LM class in transformers: the image-text-to-text model
    assert type(subject.model).__name__ == "Mistral3ForConditionalGeneration" and not subject.note
    assert build_tiny_model("mistral3").config.text_config.hidden_size == 64


def test_a_composite_whose_forward_needs_images_stands_in_by_its_language_model() -> None:
    subject = tiny_subject("blip-2")
    assert subject.tiny_type == "opt" and "requires pixel_values" in subject.note
    assert type(subject.model).__name__ == "OPTForCausalLM"


def test_gemma3n_without_timm_is_measured_on_its_language_model() -> None:
    try:
        import timm  # noqa: F401
    except ImportError:
        subject = tiny_subject("gemma3n")
        assert subject.tiny_type == "gemma3n_text" and "timm" in subject.note and "[vision] extra" in subject.note
    else:  # with the [vision] extra the composite itself builds
        subject = tiny_subject("gemma3n")
        assert subject.tiny_type == "gemma3n"


def test_derived_configs_keep_the_structure_a_patchset_must_see() -> None:
    # a hybrid keeps an attention layer (the hybrid cache sizes its mask from one)
    assert derive_tiny_config("granitemoehybrid")["layer_types"] == ["linear_attention", "full_attention"]
    assert derive_tiny_config("jamba")["attn_layer_period"] == 2
    # a composite's vision tower shrinks with widths that divide (Aya Vision's default: 1152 over 14 heads)
    vision = derive_tiny_config("aya_vision")["vision_config"]
    assert vision["hidden_size"] % vision["num_attention_heads"] == 0 and vision["image_size"] == 4 * vision["patch_size"]
    # one size per layer shrinks as the key's rule says (Gemma 3n's intermediate_size list)
    assert derive_tiny_config("gemma3n_text")["intermediate_size"] == [128, 128]
    # the types.yaml data is merged over the rules, sub-configs key by key
    assert type_overrides("qwen2_vl")["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]
    assert derive_tiny_config("qwen2_vl")["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]


def test_a_config_the_rules_do_not_shrink_is_refused_before_anything_is_allocated() -> None:
    with pytest.raises(InvalidArgument, match="would have .*M parameters.*types.yaml"):
        build_tiny_model("llama", {"hidden_size": 4096, "intermediate_size": 16384, "num_attention_heads": 32,
                                   "num_key_value_heads": 8}, check_size=True)


def test_the_committed_sweep_names_every_generative_type_of_its_release() -> None:
    import transformers

    data = json.loads(RESULTS.read_text(encoding="utf-8"))
    if data["summary"]["transformers"] != transformers.__version__:
        pytest.skip(f"the sweep ran on transformers {data['summary']['transformers']}")
    rows = data["types"]
    assert sorted(rows) == generative_types()
    for model_type, row in rows.items():  # built and run, or the reason it is not
        assert row["runs"] or row.get("reason"), model_type
    assert data["summary"]["runs"] == sum(r["runs"] for r in rows.values())


#: Types whose tiny model did not build from its config alone (coverage: "its tiny model does not build"):
#: XLNet refuses max_position_embeddings, ProphetNet num_hidden_layers (types.yaml: null, not passed),
#: X-MOD needs a default language adapter, Kolibri 1.1's indexer its own sizes; Mistral 4 and xLSTM need
#: sizes that agree (types.yaml), which the tiny copy of a user's model takes too (engine/zeroconfig/tiny_copy.py).
#: Zamba and dots3's note model: parts whose sizes must agree, which the tiny copy takes from the type's own
#: tiny config where shrinking by name alone breaks them.
ONCE_UNBUILDABLE = ["xlnet", "prophetnet", "xmod", "kolibri1_1", "mistral4", "xlstm", "zamba", "dots3_note"]


@pytest.mark.parametrize("model_type", ONCE_UNBUILDABLE)
def test_a_type_that_did_not_build_is_patched_with_no_configuration_and_computes_the_same(
        model_type: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import copy

    import engine

    monkeypatch.setenv("PATCH_ENGINE_CACHE_DIR", str(tmp_path / "cache"))  # measured and verified here, not read back
    model = build_tiny_model(model_type).eval()
    patched = copy.deepcopy(model)
    report = engine.apply(patched)
    assert any(d.action == "patch" and d.site is None for d in report.decisions), str(report)  # a module, not only rope
    ids = _ids(model)
    with torch.no_grad():
        expected, got = model(input_ids=ids)[0], patched(input_ids=ids)[0]  # logits (Mistral 4: its hidden states)
    assert torch.isfinite(expected).all()
    assert (got - expected).abs().max().item() <= 1e-5


def test_a_base_size_the_config_computes_itself_is_not_passed() -> None:
    assert derive_tiny_config("prophetnet")["num_hidden_layers"] is None
    model = build_tiny_model("prophetnet")
    assert model.config.num_encoder_layers == 2 and model.config.num_hidden_layers == 2  # its property, not an argument


def test_a_head_part_of_size_zero_stays_absent_and_nested_parts_shrink() -> None:
    # GLM-5-Next's attention has no rotary part (qk_rope_head_dim 0: its config refuses any other value)
    text = derive_tiny_config("glm5_next")["text_config"]
    assert text["qk_rope_head_dim"] == 0 and text["qk_head_dim"] == text["qk_nope_head_dim"]
    # a part made of parts (DeepSeek-OCR 2's vision: a SAM tower and an encoder) shrinks part by part
    vision = derive_tiny_config("deepseek_ocr2")["vision_config"]
    assert vision["sam_config"]["hidden_size"] == 32 and vision["encoder_config"]["hidden_size"] == 32


@pytest.mark.parametrize(("model_type", "stand_in", "cls"), [
    ("blip", "blip_text_model", "BlipTextLMHeadModel"),            # its text config has no *ForCausalLM
    ("vision-encoder-decoder", "bert", "BertLMHeadModel"),         # its language model is its decoder
    ("pi05", "paligemma", "PaliGemmaForConditionalGeneration"),    # its forward needs actions: its VLM stands in
])
def test_a_model_that_needs_more_than_token_ids_is_measured_on_its_language_model(
        model_type: str, stand_in: str, cls: str) -> None:
    subject = tiny_subject(model_type)
    assert subject.tiny_type == stand_in and type(subject.model).__name__ == cls and subject.note
    with torch.no_grad():
        logits = subject.model(input_ids=_ids(subject.model)).logits
    assert torch.isfinite(logits).all()
