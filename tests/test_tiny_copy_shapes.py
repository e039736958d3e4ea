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


def _assert_same_numbers(model: Any, patched: Any, **inputs: Any) -> None:
    """The patched model's logits and loss on ``inputs`` against the unpatched one's (the same dropout draws)."""
    numbers = []
    for m in (model, patched):
        torch.manual_seed(0)
        with torch.no_grad():
            out = m(**inputs)
        numbers.append((out.logits, out.loss))
    (want_logits, want_loss), (got_logits, got_loss) = numbers
    assert (got_logits - want_logits).abs().max().item() <= TOL
    assert abs(got_loss.item() - want_loss.item()) <= TOL

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
    patched = _applied(model)
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


def _applied(model: nn.Module) -> nn.Module:
    patched = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = engine.apply(patched)
    assert report.patched, str(report)
    assert report.zero_config.source == "measured" and not report.zero_config.problem, str(report)
    return patched


def test_a_model_whose_loss_takes_labels_per_codebook_is_probed_with_them_patched_and_computes_the_same() -> None:
    """MusicGen's decoder reads ids as (batch x codebooks, seq) and its loss labels of (batch, seq, codebooks).

    The probe read that layout off the forward's own documentation of ``input_ids`` and ``labels``
    (``num_codebooks`` from the config): labels of (batch, seq) did not fit its loss, and nothing was patched.
    """
    from engine.verification.probes import probe_batch

    model = _model("MusicgenDecoderConfig", "MusicgenForCausalLM", MUSICGEN_DECODER)
    batch = probe_batch(model)
    assert tuple(batch["input_ids"].shape) == (8, 16) and tuple(batch["labels"].shape) == (2, 16, 4)
    assert torch.equal(batch["labels"][1, :, 2], batch["input_ids"][1 * 4 + 2])  # one token, its codebook and step
    patched = _applied(model)
    ids = torch.randint(0, 99, (2 * 4, 7), generator=torch.Generator().manual_seed(1))
    labels = ids.view(2, 4, 7).transpose(1, 2)
    _assert_same_numbers(model, patched, input_ids=ids, labels=labels)
    engine.revert(patched)


def test_the_probe_of_a_causal_lm_is_still_token_ids_and_labels_of_batch_and_sequence() -> None:
    from engine.verification.probes import probe_batch

    model = _model("LlamaConfig", "LlamaForCausalLM", {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 37,
                                                       "num_hidden_layers": 1, "num_attention_heads": 4})
    batch = probe_batch(model)
    assert {k: tuple(v.shape) for k, v in batch.items()} == {"input_ids": (2, 16), "labels": (2, 16)}


DIFFUSION_GEMMA = {
    "text_config": {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 2,
                    "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 256,
                    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 512, "rms_norm_eps": 1e-06,
                    "pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1, "tie_word_embeddings": True,
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                           "rope_theta": 1000000.0}},
                    "sliding_window": 512, "layer_types": ["sliding_attention", "full_attention"],
                    "use_bidirectional_attention": "vision", "num_experts": 4, "top_k_experts": 2,
                    "moe_intermediate_size": 8, "moe_num_shared_experts": 1, "per_layer_config": {"1": {"head_dim": 16}},
                    "model_type": "diffusion_gemma_text"},
    "vision_config": {"hidden_size": 16, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 4,
                      "num_key_value_heads": 1, "head_dim": 64, "hidden_activation": "gelu_pytorch_tanh",
                      "rms_norm_eps": 1e-06, "max_position_embeddings": 131072,
                      "rope_parameters": {"rope_theta": 100.0, "rope_type": "axial"}, "pooling_kernel_size": 2,
                      "patch_size": 5, "position_embedding_size": 10240, "use_clipped_linears": False,
                      "standardize": False, "image_size": 20, "num_channels": 3, "model_type": "gemma4_vision"},
    "boi_token_id": 5, "eoi_token_id": 6, "image_token_id": 4, "tie_word_embeddings": True, "canvas_length": 16,
    "mm_tokens_per_image": 2, "self_conditioning_size": 16,
}


def test_a_model_whose_forward_returns_only_logits_is_verified_on_their_mean_square_and_computes_the_same() -> None:
    """DiffusionGemma's block diffusion takes no labels and returns logits alone (no loss, no hidden states):
    the verification's training step runs backward on the mean square of its logits, as for a base model's
    hidden states (before: nothing patched, 'neither a loss nor hidden states')."""
    model = _model("DiffusionGemmaConfig", "DiffusionGemmaForBlockDiffusion", DIFFUSION_GEMMA)
    patched = _applied(model)
    ids = torch.randint(7, 99, (2, 16), generator=torch.Generator().manual_seed(1))
    grads = []
    for m in (model, patched):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(0)
        out = m(input_ids=ids)
        assert getattr(out, "loss", None) is None
        out.logits.float().square().mean().backward()
        grads.append((out.logits.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    (want, want_grads), (got, got_grads) = grads
    assert (got - want).abs().max().item() <= TOL
    assert want_grads.keys() == got_grads.keys() and want_grads
    assert all((got_grads[n] - g).abs().max().item() <= TOL for n, g in want_grads.items())
    engine.revert(patched)


T5GEMMA2_TEXT = {
    "vocab_size": 99, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8, "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 512,
    "rms_norm_eps": 1e-06, "pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": True,
    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}},
    "query_pre_attn_scalar": 256, "sliding_window": 4096, "layer_types": ["full_attention", "sliding_attention"],
}
T5GEMMA2 = {
    "encoder": {"text_config": {**T5GEMMA2_TEXT, "model_type": "t5gemma2_text"},
                "vision_config": {"hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "num_channels": 3, "image_size": 20, "patch_size": 5,
                                  "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-06,
                                  "vision_use_head": True, "model_type": "siglip_vision_model"},
                "mm_tokens_per_image": 2, "boi_token_index": 5, "eoi_token_index": 6, "image_token_index": 4,
                "tie_word_embeddings": True, "hidden_size": 32, "model_type": "t5gemma2_encoder"},
    "decoder": {**T5GEMMA2_TEXT, "cross_attention_hidden_size": 32, "is_decoder": True,
                "model_type": "t5gemma2_decoder"},
    "image_token_index": 4, "eoi_token_index": 6, "tie_word_embeddings": True, "vocab_size": 99, "is_encoder_decoder": True,
}


def test_an_encoder_decoder_whose_config_refuses_the_rules_sizes_is_copied_at_the_types_patched_and_computes_the_same(
) -> None:
    """T5Gemma 2: the size rules shrink its encoder and decoder to different widths, which its config class refuses
    (a validation error, not an InvalidArgument: it ended the measurement); the next sizes are tried. Its decoder
    reads ids made from the labels, so the scaffold's forward without labels gives it the batch's ids."""
    model = _model("T5Gemma2Config", "T5Gemma2ForConditionalGeneration", T5GEMMA2)
    tiny = tiny_copy(model)
    assert tiny.config.encoder.text_config.hidden_size == tiny.config.decoder.hidden_size
    patched = _applied(model)
    want_logits, want_loss = _numbers(model, 7)  # ids below its image and special tokens
    got_logits, got_loss = _numbers(patched, 7)
    assert (got_logits - want_logits).abs().max().item() <= TOL
    assert abs(got_loss.item() - want_loss.item()) <= TOL
    engine.revert(patched)


IDEFICS = {
    "vocab_size": 99, "additional_vocab_size": 0, "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
    "num_attention_heads": 4, "hidden_act": "gelu", "alpha_initializer": "ones", "rms_norm_eps": 1e-06,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False, "cross_layer_interval": 1,
    "use_resampler": False, "max_position_embeddings": 512,
    "vision_config": {"embed_dim": 32, "image_size": 30, "intermediate_size": 37, "patch_size": 2,
                      "num_hidden_layers": 2, "num_attention_heads": 4, "num_channels": 3, "hidden_act": "gelu",
                      "layer_norm_eps": 1e-05},
    "perceiver_config": {"use_resampler": False},
}


def test_a_decoder_cross_attending_to_its_images_is_probed_with_images_per_sample_patched_and_computes_the_same(
) -> None:
    """IDEFICS reads images as (batch, images, C, H, W) with an ``image_attention_mask`` of (batch, seq, images);
    the probe drew (batch, C, H, W) and no mask, and its forward failed ('not enough values to unpack')."""
    from engine.verification.probes import probe_batch

    model = _model("IdeficsConfig", "IdeficsForVisionText2Text", IDEFICS)
    batch = probe_batch(model)
    assert tuple(batch["pixel_values"].shape) == (2, 1, 3, 30, 30)
    assert tuple(batch["image_attention_mask"].shape) == (2, 16, 1)
    patched = _applied(model)
    pixels = torch.randn(2, 1, 3, 30, 30, generator=torch.Generator().manual_seed(2))
    ids = torch.randint(3, 99, (2, 7), generator=torch.Generator().manual_seed(1))
    numbers = []
    for m in (model, patched):
        torch.manual_seed(0)
        with torch.no_grad():
            out = m(input_ids=ids, labels=ids, pixel_values=pixels,
                    image_attention_mask=torch.ones(2, 7, 1, dtype=torch.long))
        numbers.append((out.logits, out.loss))
    (want_logits, want_loss), (got_logits, got_loss) = numbers
    assert (got_logits - want_logits).abs().max().item() <= TOL
    assert abs(got_loss.item() - want_loss.item()) <= TOL
    engine.revert(patched)


REFORMER = {
    "attention_head_size": 64, "attn_layers": ["local", "local"], "axial_pos_embds": True, "axial_pos_shape": [4, 8],
    "axial_pos_embds_dim": [16, 16], "chunk_size_lm_head": 0, "eos_token_id": 2, "feed_forward_size": 32,
    "hash_seed": 0, "hidden_act": "gelu", "hidden_dropout_prob": 0.0, "hidden_size": 32, "is_decoder": True,
    "layer_norm_eps": 1e-12, "local_num_chunks_before": 1, "local_num_chunks_after": 0,
    "local_attention_probs_dropout_prob": 0.0, "local_attn_chunk_length": 4, "lsh_attn_chunk_length": None,
    "lsh_attention_probs_dropout_prob": None, "lsh_num_chunks_before": None, "lsh_num_chunks_after": None,
    "max_position_embeddings": 512, "num_attention_heads": 2, "num_buckets": None, "num_hashes": 1, "vocab_size": 32,
    "tie_word_embeddings": False, "pad_token_id": 0, "num_hidden_layers": 2,
}


def test_a_model_with_axial_position_embeddings_is_probed_at_their_length_patched_and_computes_the_same() -> None:
    """Reformer trains only on a sequence that fills its axial position grid (4 x 8 = 32 tokens); the probe's 16
    did not run, and nothing was patched."""
    from engine.verification.probes import probe_batch

    model = _model("ReformerConfig", "ReformerModelWithLMHead", REFORMER)
    assert tuple(probe_batch(model)["input_ids"].shape) == (2, 32)
    patched = _applied(model)
    ids = torch.randint(0, 32, (2, 32), generator=torch.Generator().manual_seed(1))
    _assert_same_numbers(model, patched, input_ids=ids, labels=ids)
    engine.revert(patched)


UDOP = {
    "vocab_size": 99, "d_model": 32, "d_kv": 8, "d_ff": 37, "num_layers": 2, "num_decoder_layers": 2, "num_heads": 4,
    "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
    "relative_bias_args": [{"type": "1d"}, {"type": "horizontal"}, {"type": "vertical"}], "dropout_rate": 0.0,
    "feed_forward_proj": "relu", "pad_token_id": 0, "eos_token_id": 1, "max_2d_position_embeddings": 1024,
    "image_size": 224, "patch_size": 16, "num_channels": 3, "tie_word_embeddings": True, "decoder_start_token_id": 0,
}


def test_a_model_whose_forward_needs_an_input_no_probe_makes_says_so_instead_of_a_crash() -> None:
    """UDOP's encoder needs each token's bounding box (``bbox``), which no probe makes: nothing patched, in words."""
    model = _model("UdopConfig", "UdopForConditionalGeneration", UDOP)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = engine.apply(model)
    problem = report.zero_config.problem
    assert not report.patched and NO_PROBE_INPUTS in problem, problem
    assert problem.startswith("UdopForConditionalGeneration cannot be measured on a tiny copy: "), problem
    assert "its forward fails on the engine's probe inputs" in problem and "Bbox is required" in problem, problem
