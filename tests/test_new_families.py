"""The ops issue 41's families needed, on their own functions and kernels (the families' tiny models
are in tests/test_families.py, by their bundled patchsets).

* rope ``interleaved_repeated`` (+ ``upcast``): Cohere's and Cohere 2's ``apply_rotary_pos_emb``, bit for bit;
  the GLM ``interleaved`` layout, which repeats the first half of cos itself, is not it.
* partial rotary (``rotary_pct`` / ``partial_rotary_factor``) needs no new setting: GPT-NeoX's function
  rotates the first ``cos.shape[-1]`` features and passes the rest, as the ``half`` reference does.
* the ``mlp`` op's vendor kernels: ``npu_gelu`` (against the emulator of its documented contract) and
  liger's ``LigerReLUSquaredFunction`` (interpreted on the CPU), and the ones ``auto`` passes over.
* the ``layer_norm`` variants' liger kernel: a parameterless norm (OLMo 1) runs with ones and zeros;
  a per-head weight (Cohere's q/k norms) is passed over by ``auto``, with the reason in the plan.
"""

from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch
from conftest import tiny_for

import engine
from engine.kernels import registry
from engine.ops.base import get_op
from engine.ops.rope import build_reference
from engine.schema import LayerNormPatch, MlpPatch, RopeLayout, RopePatch

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None


def _qk_cos_sin(dtype: torch.dtype, head_dim: int = 16, rotary: int | None = None, repeated: bool = False):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, head_dim, generator=g).to(dtype)
    k = torch.randn(2, 2, 6, head_dim, generator=g).to(dtype)
    width = rotary or head_dim
    freqs = torch.rand(2, 6, width // 2, generator=g) * 6
    emb = torch.repeat_interleave(freqs, 2, dim=-1) if repeated else torch.cat((freqs, freqs), dim=-1)
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.parametrize("family", ["cohere", "cohere2"])
@DTYPES
def test_interleaved_repeated_is_cohere_rope_bit_for_bit(family: str, dtype: torch.dtype) -> None:
    modeling = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    q, k, cos, sin = _qk_cos_sin(dtype, repeated=True)
    want = modeling.apply_rotary_pos_emb(q, k, cos, sin)
    patch = RopePatch(op="rope", layout=RopeLayout.interleaved_repeated, upcast=True)
    get_op("rope").check_function(modeling.apply_rotary_pos_emb, patch)
    got = build_reference(patch)(q, k, cos, sin)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want, strict=True))
    glm = build_reference(RopePatch(op="rope", layout=RopeLayout.interleaved, upcast=True))(q, k, cos, sin)
    assert not torch.allclose(glm[0].float(), want[0].float(), atol=1e-2)  # GLM's layout repeats cos itself


@DTYPES
def test_partial_rotary_needs_no_setting(dtype: torch.dtype) -> None:
    """GPT-NeoX (rotary_pct 0.25): cos covers a quarter of the head; the half reference rotates that quarter."""
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

    q, k, cos, sin = _qk_cos_sin(dtype, head_dim=16, rotary=4)
    want = apply_rotary_pos_emb(q, k, cos, sin)
    got = build_reference(RopePatch(op="rope"))(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(got[0][..., 4:], q[..., 4:])  # the features past cos's width pass through


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh"])
@DTYPES
def test_npu_gelu_provider_follows_the_documented_contract(torch_npu, activation: str, dtype: torch.dtype) -> None:
    patch = MlpPatch(target="X", op="mlp", activation=activation)
    h = (torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    got = registry.get("npu", "mlp").build(patch)(h)
    want = registry.get("torch", "mlp").build(patch)(h)
    assert torch_npu.calls == ["npu_gelu"] and got.dtype == want.dtype
    torch.testing.assert_close(got, want, atol=1e-6 if dtype is torch.float32 else 2e-2, rtol=1e-2)


def test_providers_refuse_the_activations_they_have_no_kernel_for() -> None:
    from engine.kernels.liger import _mlp_supports as liger_supports
    from engine.kernels.npu import _mlp_supports as npu_supports

    def patch(activation: str) -> MlpPatch:
        return MlpPatch(target="X", op="mlp", activation=activation)

    assert liger_supports(patch("relu2")) is None and "relu2 only" in liger_supports(patch("gelu_new"))
    assert npu_supports(patch("gelu")) is None and "npu_gelu" in npu_supports(patch("relu2"))


def test_gpt_neox_patched_on_npu_runs_npu_gelu_and_matches(torch_npu) -> None:
    """The whole family through the npu plan (emulated): the MLP's activation is npu_gelu, logits as unpatched."""
    from engine.verification import probe_batch

    model = tiny_for("gpt_neox")
    reference = tiny_for("gpt_neox")
    report = engine.apply(model, "gpt_neox", device="npu")
    mlp = [d for d in report.decisions if d.op == "mlp" and d.action == "patch"]
    assert mlp and {d.kernel for d in mlp} == {"npu"}
    batch = probe_batch(reference, seq=12)
    with torch.no_grad():
        want, got = reference(**batch).logits, model(**batch).logits
    assert "npu_gelu" in torch_npu.calls
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.fixture
def interpreted():
    from engine.kernels.triton_interpret import interpreting

    with interpreting():
        yield


@pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel is not installed (extra: cuda)")
def test_liger_relu_squared_interpreted_matches_the_reference(interpreted) -> None:
    patch = MlpPatch(target="X", op="mlp", activation="relu2")
    h = torch.randn(6, 48, generator=torch.Generator().manual_seed(0), requires_grad=True)
    got = registry.get("liger", "mlp").build(patch)(h)
    (g_got,) = torch.autograd.grad(got.sum(), h)
    want = registry.get("torch", "mlp").build(patch)(h)
    (g_want,) = torch.autograd.grad(want.sum(), h)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(g_got, g_want, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel is not installed (extra: cuda)")
def test_liger_layer_norm_without_parameters_interpreted(interpreted) -> None:
    """OLMo 1's norm has no weight or bias: liger's kernel reads both, so it is given ones and zeros."""
    patch = LayerNormPatch(target="OlmoLayerNorm", op="layer_norm", weight_attr=None, eps=1e-5, precision="fp32")
    x = torch.randn(6, 32, generator=torch.Generator().manual_seed(0)) * 3 + 1
    got = registry.get("liger", "layer_norm").build(patch)(x, None, None, 1e-5)
    want = registry.get("torch", "layer_norm").build(patch)(x, None, None, 1e-5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cuda_plan_passes_liger_over_for_a_per_head_weight() -> None:
    """Cohere's q/k norms (use_qk_norm) hold a (heads, head_dim) weight, which liger's LayerNorm cannot take.
    One kernel serves a patch's modules, so with them the class's patch runs torch, with the reason in the
    plan; without them (Command R v01's default) liger runs every CohereLayerNorm."""
    pytest.importorskip("liger_kernel")  # the `cuda` extra: without it `auto` passes liger over for another reason
    with_qk = engine.plan(tiny_for("cohere"), "cohere", device="cuda")
    norms = [d for d in with_qk.decisions if d.op == "layer_norm"]
    assert any(d.path.endswith("q_norm") for d in norms)
    assert {d.kernel for d in norms} == {"torch"} and all("per-head" in d.reason for d in norms)
    without = engine.plan(tiny_for("cohere", use_qk_norm=False), "cohere", device="cuda")
    norms = [d for d in without.decisions if d.op == "layer_norm"]
    assert norms and {d.kernel for d in norms} == {"liger"}


@DTYPES
def test_npu_rotary_mul_runs_cohere_rope_in_interleave_mode(torch_npu, dtype: torch.dtype) -> None:
    """npu_rotary_mul's interleave mode takes cos/sin repeated per pair: Cohere's arrive so, passed as they are."""
    from transformers.models.cohere.modeling_cohere import apply_rotary_pos_emb

    q, k, cos, sin = _qk_cos_sin(dtype, repeated=True)
    patch = RopePatch(op="rope", layout=RopeLayout.interleaved_repeated, upcast=True)
    got = registry.get("npu", "rope").build(patch)(q, k, cos, sin)
    want = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch_npu.calls == ["npu_rotary_mul", "npu_rotary_mul"]
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
