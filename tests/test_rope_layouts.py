"""The rope layouts against transformers' own rotary functions, bit for bit in fp32 and bf16.

half + upcast: the Qwen-VL vision functions; interleaved: GLM / GLM-4 (partial rotary);
interleaved_to_half: DeepSeek-V3; complex: Llama 4 text and vision. Plus the plan-time
contract: a layout whose function has another signature is refused with the fix.
"""

from __future__ import annotations

import importlib

import pytest
import torch
from pydantic import ValidationError

from engine.errors import SignatureMismatch
from engine.kernels import registry
from engine.ops.base import get_op
from engine.schema import RopePatch

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _function(module: str, name: str):
    return getattr(importlib.import_module(f"transformers.models.{module}"), name)


def _cos_sin(seq: int, rot: int, dtype: torch.dtype, batch: int | None = 2):
    freqs = torch.arange(seq, dtype=torch.float32)[:, None] * (0.7 ** torch.arange(rot // 2))[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    if batch is not None:
        emb = emb.expand(batch, seq, rot)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _qk(shape_q, shape_k, dtype):
    g = torch.Generator().manual_seed(0)
    return torch.randn(*shape_q, generator=g).to(dtype), torch.randn(*shape_k, generator=g).to(dtype)


def _check(patch: RopePatch, original, args, kwargs=None) -> None:
    kwargs = kwargs or {}
    get_op("rope").check_function(original, patch)
    got = registry.get("torch", "rope").build(patch)(*args, **kwargs)
    want = original(*args, **kwargs)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)


@pytest.mark.parametrize("module", ["glm.modeling_glm", "glm4.modeling_glm4"])
@pytest.mark.parametrize("rot", [16, 8], ids=["full", "partial"])
@DTYPES
def test_interleaved_matches_glm(module, rot, dtype) -> None:
    q, k = _qk((2, 4, 6, 16), (2, 2, 6, 16), dtype)
    cos, sin = _cos_sin(6, rot, dtype)
    patch = RopePatch(op="rope", layout="interleaved")
    _check(patch, _function(module, "apply_rotary_pos_emb"), (q, k, cos, sin))


@DTYPES
def test_interleaved_to_half_matches_deepseek_v3(dtype) -> None:
    q, k = _qk((2, 4, 6, 8), (2, 1, 6, 8), dtype)
    cos, sin = _cos_sin(6, 8, dtype)
    patch = RopePatch(op="rope", function="apply_rotary_pos_emb_interleave", layout="interleaved_to_half")
    _check(patch, _function("deepseek_v3.modeling_deepseek_v3", "apply_rotary_pos_emb_interleave"), (q, k, cos, sin))


@pytest.mark.parametrize("module", ["qwen2_vl.modeling_qwen2_vl", "qwen2_5_vl.modeling_qwen2_5_vl",
                                    "qwen3_vl.modeling_qwen3_vl", "qwen3_5.modeling_qwen3_5"])
@DTYPES
def test_upcast_matches_the_qwen_vision_rotary(module, dtype) -> None:
    q, k = _qk((10, 2, 16), (10, 2, 16), dtype)
    cos, sin = _cos_sin(10, 16, dtype, batch=None)
    patch = RopePatch(op="rope", function="apply_rotary_pos_emb_vision", upcast=True, unsqueeze_dim=-2)
    _check(patch, _function(module, "apply_rotary_pos_emb_vision"), (q, k, cos, sin))


@DTYPES
def test_complex_matches_llama4_text_and_vision(dtype) -> None:
    text = _function("llama4.modeling_llama4", "apply_rotary_emb")
    vision = _function("llama4.modeling_llama4", "vision_apply_rotary_emb")
    angles = torch.rand(2, 6, 8) * 6
    freqs_cis = torch.polar(torch.ones_like(angles), angles)  # (batch, seq, head_dim / 2)
    xq, xk = _qk((2, 6, 4, 16), (2, 6, 2, 16), dtype)  # (batch, seq, heads, head_dim)
    _check(RopePatch(op="rope", function="apply_rotary_emb", layout="complex"), text, (xq, xk, freqs_cis))
    vq, vk = _qk((3, 5, 2, 16), (3, 5, 2, 16), dtype)
    freqs_ci = torch.polar(torch.ones(5, 1, 8), torch.rand(5, 1, 8) * 6)
    _check(RopePatch(op="rope", function="vision_apply_rotary_emb", layout="complex"), vision, (vq, vk),
           {"freqs_ci": freqs_ci})


@pytest.mark.parametrize(
    ("patch", "function", "message"),
    [
        (RopePatch(op="rope", function="apply_rotary_emb"), ("llama4.modeling_llama4", "apply_rotary_emb"),
         "a function taking freqs_cis is layout complex"),
        (RopePatch(op="rope", layout="complex"), ("llama.modeling_llama", "apply_rotary_pos_emb"),
         "expected (xq, xk, freqs_cis)"),
        (RopePatch(op="rope", layout="interleaved_to_half"), ("llama.modeling_llama", "apply_rotary_pos_emb"),
         "expected (q, k, cos, sin, position_ids, unsqueeze_dim"),
        (RopePatch(op="rope", unsqueeze_dim=-2), ("llama.modeling_llama", "apply_rotary_pos_emb"),
         "its unsqueeze_dim defaults to 1"),
    ],
    ids=["half-on-complex", "complex-on-half", "deepseek-on-half", "unsqueeze"],
)
def test_plan_time_refusals(patch, function, message) -> None:
    with pytest.raises(SignatureMismatch) as info:
        get_op("rope").check_function(_function(*function), patch)
    assert message in str(info.value)


def test_half_layout_on_glm_changes_the_numbers() -> None:
    """The layouts are not interchangeable: declaring half on GLM's function would be wrong."""
    q, k = _qk((1, 2, 4, 16), (1, 2, 4, 16), torch.float32)
    cos, sin = _cos_sin(4, 16, torch.float32, batch=1)
    got = registry.get("torch", "rope").build(RopePatch(op="rope"))(q, k, cos, sin)
    want = _function("glm.modeling_glm", "apply_rotary_pos_emb")(q, k, cos, sin)
    assert not torch.allclose(got[0], want[0], atol=1e-3)


def test_layout_specific_settings_are_refused_elsewhere() -> None:
    with pytest.raises(ValidationError, match="apply to layouts half and interleaved only"):
        RopePatch(op="rope", layout="complex", upcast=True)


@pytest.mark.parametrize(
    ("module", "name", "expected"),
    [
        ("glm.modeling_glm", "apply_rotary_pos_emb", {"half", "interleaved", "interleaved_repeated"}),
        ("deepseek_v3.modeling_deepseek_v3", "apply_rotary_pos_emb_interleave", {"interleaved_to_half"}),
        ("llama4.modeling_llama4", "apply_rotary_emb", {"complex"}),
        ("qwen2_vl.modeling_qwen2_vl", "apply_rotary_pos_emb_vision", {"half", "interleaved", "interleaved_repeated"}),
    ],
)
def test_scaffold_candidates_follow_the_signature(module, name, expected) -> None:
    candidates = list(get_op("rope").candidates(name, _function(module, name)))
    assert {c.layout.value for c in candidates} == expected
    if name.endswith("_vision"):
        assert {c.unsqueeze_dim for c in candidates} == {-2} and {c.upcast for c in candidates} == {False, True}
