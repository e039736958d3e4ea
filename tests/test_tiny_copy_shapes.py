"""The tiny copy zero configuration measures on, for models whose config is already tiny (issue 47).

Each model is built from the config transformers' own tester builds for its type (copied here:
no test tree needed), weights perturbed, then ``engine.apply(model)`` with no patchset. The size
rules are written for a checkpoint's config; on a config this small they grew some sizes past
others that must agree with them, and the copy crashed: Laguna's KV heads 2 -> 4 beside its
per-layer list of 2 query heads, HRM-Text's 16 cache slots cut to 2 beside 2 layers per stack run
8 times, GLM-4.6V's vision width 48 -> 64 beside its 12 heads. Such a model is copied at its own
sizes. A model whose forward does not run on the engine's probe inputs at any size says why in
plain words instead of a crash text.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import engine
from engine.tiny import perturb_
from engine.zeroconfig import tiny_copy as tiny_copy_module
from engine.zeroconfig.tiny_copy import NO_PROBE_INPUTS, tiny_copy

TOL = 1e-5

LAGUNA = {
    "vocab_size": 64, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "hidden_act": "gelu", "max_position_embeddings": 512, "rms_norm_eps": 1e-06,
    "tie_word_embeddings": False, "sliding_window": 32, "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16, "num_experts_per_tok": 2, "num_experts": 8,
    "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
                        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 1.0}},
    "layer_types": ["full_attention", "sliding_attention"], "head_dim": 8, "gating": True,
    "num_attention_heads_per_layer": [2, 2], "mlp_layer_types": ["dense", "sparse"],
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
HRM_TEXT = {
    "vocab_size": 99, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 16, "num_attention_heads": 2,
    "hidden_act": "gelu", "max_position_embeddings": 512, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}, "head_dim": 16, "H_cycles": 2, "L_cycles": 3,
    "L_bp_cycles": [2], "embedding_scale": 50.0, "prefix_lm": False, "num_layers_per_stack": 2,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}
GLM46V = {
    "text_config": {"vocab_size": 99, "hidden_size": 16, "intermediate_size": 22, "num_hidden_layers": 2,
                    "num_attention_heads": 2, "num_key_value_heads": 1, "hidden_act": "silu",
                    "max_position_embeddings": 512, "rms_norm_eps": 1e-05, "pad_token_id": 0,
                    "rope_parameters": {"type": "default", "mrope_section": [2, 1, 1], "rope_theta": 10000,
                                        "rope_type": "default"},
                    "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0, "model_type": "glm4v_text"},
    "vision_config": {"depth": 2, "hidden_size": 48, "hidden_act": "silu", "num_heads": 12, "in_channels": 3,
                      "image_size": 336, "patch_size": 14, "rms_norm_eps": 1e-05, "spatial_merge_size": 1,
                      "temporal_patch_size": 2, "out_hidden_size": 16, "intermediate_size": 22,
                      "model_type": "glm4v_vision"},
    "image_token_id": 7, "video_token_id": 8, "image_start_token_id": 5, "image_end_token_id": 6,
    "video_start_token_id": 3, "video_end_token_id": 4, "tie_word_embeddings": False,
}
MUSICGEN_DECODER = {
    "vocab_size": 99, "max_position_embeddings": 2048, "num_hidden_layers": 2, "ffn_dim": 4096,
    "num_attention_heads": 4, "hidden_size": 16, "num_codebooks": 4, "audio_channels": 1, "pad_token_id": 99,
    "bos_token_id": 99, "tie_word_embeddings": False, "dropout": 0.0,
}


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh verdict and measurement cache per test: each test measures and verifies for itself."""
    monkeypatch.setenv("PATCH_ENGINE_CACHE_DIR", str(tmp_path / "cache"))


def _model(config_cls: str, model_cls: str, values: dict[str, Any]) -> nn.Module:
    import transformers

    config = getattr(transformers, config_cls)(**values)
    torch.manual_seed(0)
    return perturb_(getattr(transformers, model_cls)(config), seed=0).train()


def _numbers(model: nn.Module, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids)
    return out.logits, out.loss


CASES = {
    "laguna": ("LagunaConfig", "LagunaForCausalLM", LAGUNA, 64),
    "hrm_text": ("HrmTextConfig", "HrmTextForCausalLM", HRM_TEXT, 99),
    "glm46v": ("Glm46VConfig", "Glm46VForConditionalGeneration", GLM46V, 5),  # ids below its image tokens
}


@pytest.mark.parametrize("model_type", sorted(CASES))
def test_a_model_already_tiny_is_copied_at_its_own_sizes_patched_and_computes_the_same(model_type: str) -> None:
    config_cls, model_cls, values, vocab = CASES[model_type]
    model = _model(config_cls, model_cls, values)
    tiny = tiny_copy(model)
    by_rules = tiny_copy_module._built(type(model), tiny_copy_module.shrunk_config(model.config), 0)
    with pytest.raises(tiny_copy_module._NotRunning):  # what crashed before: the rules' sizes do not agree
        tiny_copy_module._runs_on_probes(by_rules)
    tiny_copy_module._runs_on_probes(tiny)  # the copy taken runs as the scaffold and the verifier run it
    patched = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = engine.apply(patched)
    assert report.patched, str(report)
    assert report.zero_config.source == "measured" and not report.zero_config.problem, str(report)
    want_logits, want_loss = _numbers(model, vocab)
    got_logits, got_loss = _numbers(patched, vocab)
    assert (got_logits - want_logits).abs().max().item() <= TOL
    assert abs(got_loss.item() - want_loss.item()) <= TOL
    engine.revert(patched)


def test_a_config_the_size_rules_can_shrink_is_still_shrunk_by_them() -> None:
    """The rules' copy comes first: a small Llama (tester sizes) is measured at the tiny base sizes, as before."""
    model = _model("LlamaConfig", "LlamaForCausalLM", {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 37,
                                                       "num_hidden_layers": 2, "num_attention_heads": 4,
                                                       "num_key_value_heads": 2})
    tiny = tiny_copy(model)
    assert (tiny.config.hidden_size, tiny.config.vocab_size) == (64, 256)


def test_the_per_layer_heads_agree_with_the_kv_heads_in_the_copy() -> None:
    """Laguna's copy by the rules had 4 KV heads beside 2 query heads per layer: 2 // 4 = 0 KV groups."""
    tiny = tiny_copy(_model(*CASES["laguna"][:3]))
    heads = tiny.config.num_attention_heads_per_layer
    assert all(h % tiny.config.num_key_value_heads == 0 and h >= tiny.config.num_key_value_heads for h in heads)


def test_a_config_whose_sizes_no_rule_can_shrink_is_copied_at_its_own_sizes() -> None:
    """HRM-Text's ``num_hidden_layers`` is its cache slots (2 layers per stack x 2 H-cycles x 4): cut to 2, the
    copy's cache has no slot for the third attention call; the type's sizes keep the user's 2 layers per stack too."""
    model = _model(*CASES["hrm_text"][:3])
    tiny = tiny_copy(model)
    assert (tiny.config.num_hidden_layers, tiny.config.num_layers_per_stack, tiny.config.hidden_size) == (16, 2, 32)
    assert sum(p.numel() for p in tiny.parameters()) == sum(p.numel() for p in model.parameters())


def test_a_model_whose_loss_takes_other_labels_says_so_instead_of_a_crash() -> None:
    """MusicGen's decoder reads ids as (batch x codebooks, seq) and its loss labels per codebook.

    The type's tiny sizes give the copy one codebook, so the probe's ids run; its labels of
    (batch, seq) do not fit a loss that takes (batch, seq, codebooks): nothing patched, and it says that.
    """
    model = _model("MusicgenDecoderConfig", "MusicgenForCausalLM", MUSICGEN_DECODER)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = engine.apply(model)
    problem = report.zero_config.problem
    assert not report.patched and NO_PROBE_INPUTS in problem, problem
    assert "its loss does not take the engine's probe labels" in problem and "type's tiny sizes" in problem, problem
    assert problem.startswith("MusicgenForCausalLM cannot be measured on a tiny copy: "), problem
