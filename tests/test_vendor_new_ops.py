"""npu and liger providers of geglu, layer_norm and the rope layouts, on a CPU.

npu: against the emulator of torch_npu's documented contracts (tests/npu_emulator.py),
whole families included (gemma's GeGLU, GLM's interleaved rope, Qwen2-VL's vision rope).
liger: the real kernels run under Triton's CPU interpreter (engine.kernels.triton_interpret); the
layouts liger has no kernel for are passed over by ``auto`` with the reason in the plan.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from conftest import tiny_for
from test_liger_fla import _vendor_vs_torch

import engine
from engine.kernels import registry
from engine.schema import GegluPatch, LayerNormPatch, RopePatch
from engine.verification import probe_batch

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None


@pytest.fixture
def interpreted():
    """Triton kernels launched in the test run on the CPU with Triton's interpreter (engine's shims)."""
    from engine.kernels.triton_interpret import interpreting

    with interpreting():
        yield
needs_liger = pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel is not installed (extra: cuda)")



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_npu_geglu_within_one_rounding(torch_npu, dtype) -> None:
    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(4, 64, generator=g) * 3).to(dtype), torch.randn(4, 64, generator=g).to(dtype)
    got = registry.get("npu", "geglu").build(GegluPatch(target="X", op="geglu"))(gate, up)
    want = registry.get("torch", "geglu").build(GegluPatch(target="X", op="geglu"))(gate, up)
    assert torch_npu.calls == ["npu_geglu"] and got.dtype == want.dtype
    exact = (torch.nn.functional.gelu(gate.float(), approximate="tanh") * up.float()).to(dtype)
    assert torch.equal(got, exact)  # the fused op rounds once
    torch.testing.assert_close(got, want, atol=1e-6 if dtype is torch.float32 else 2e-2, rtol=1e-2)


@pytest.mark.parametrize(
    ("patch", "q_shape", "cos_shape"),
    [
        (RopePatch(op="rope", layout="interleaved"), (2, 4, 6, 16), (2, 6, 8)),  # GLM: partial rotary
        (RopePatch(op="rope", function="apply_rotary_pos_emb_vision", upcast=True, unsqueeze_dim=-2),
         (10, 2, 16), (10, 16)),  # the Qwen-VL vision layout (seq, heads, dim)
    ],
    ids=["interleaved", "vision-upcast"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_npu_rope_layouts(torch_npu, patch, q_shape, cos_shape, dtype) -> None:
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(*q_shape, generator=g).to(dtype), torch.randn(*q_shape, generator=g).to(dtype)
    angles = torch.rand(*cos_shape[:-1], cos_shape[-1] // 2, generator=g) * 6
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    got = registry.get("npu", "rope").build(patch)(q, k, cos, sin)
    want = registry.get("torch", "rope").build(patch)(q, k, cos, sin)
    assert "npu_rotary_mul" in torch_npu.calls
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype is torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, **tol)


def test_npu_passes_over_layouts_it_has_no_mode_for(torch_npu) -> None:
    model = tiny_for("deepseek_v3")
    plan = engine.plan(model, "deepseek_v3", device="npu")
    [rope] = [d for d in plan.decisions if d.op == "rope"]
    assert rope.kernel == "torch" and "npu_rotary_mul has no interleaved_to_half mode" in rope.reason


@pytest.mark.parametrize("name", ["gemma", "glm", "qwen2_vl"])
def test_npu_families_match_unpatched(torch_npu, name) -> None:
    reference = tiny_for(name)
    patched = copy.deepcopy(reference)
    report = engine.apply(patched, name, device="npu")
    assert {d.op for d in report.decisions if d.kernel == "npu"} >= ({"geglu"} if name == "gemma" else {"rope"})
    batch = probe_batch(reference, seq=12)
    ref, pat = reference(**batch), patched(**batch)
    torch.testing.assert_close(pat.logits, ref.logits, atol=1e-5, rtol=1e-5)
    assert set(torch_npu.calls) >= {"npu_rotary_mul"}


def test_liger_refuses_what_it_cannot_compute() -> None:
    assert registry.get("liger", "geglu").supports(GegluPatch(target="X", op="geglu", approximate="none"))
    assert registry.get("liger", "rope").supports(RopePatch(op="rope", layout="interleaved"))
    assert registry.get("liger", "rope").supports(RopePatch(op="rope", layout="complex")) is None
    model = tiny_for("glm")
    plan = engine.plan(model, "glm", device="cuda", mode="inference")
    [rope] = [d for d in plan.decisions if d.op == "rope"]
    assert rope.kernel == "torch" and "liger has no kernel for the interleaved rotary layout" in rope.reason


@needs_liger
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_liger_geglu_and_layer_norm_interpreted(interpreted, dtype) -> None:
    """liger's GeGLU and LayerNorm kernels (libdevice tanh / rsqrt: the libdevice shim), forward and backward."""
    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(4, 64, generator=g) * 2).to(dtype), torch.randn(4, 64, generator=g).to(dtype)
    grad = dtype is torch.float32
    _vendor_vs_torch("liger", "geglu", GegluPatch(target="X", op="geglu"), (gate, up), grad=grad)
    x = (torch.randn(2, 3, 32, generator=g) * 2 + 1).to(dtype)
    w, b = (1 + 0.1 * torch.randn(32, generator=g)).to(dtype), (0.1 * torch.randn(32, generator=g)).to(dtype)
    plain = LayerNormPatch(target="X", op="layer_norm")
    _vendor_vs_torch("liger", "layer_norm", plain, (x, w, b, 1e-6), grad=grad)
    _vendor_vs_torch("liger", "layer_norm", plain, (x, w, None, 1e-6), grad=grad)  # no bias: zeros passed
    nemotron = LayerNormPatch(target="X", op="layer_norm", scale="one_plus_weight")
    _vendor_vs_torch("liger", "layer_norm", nemotron, (x, w - 1, b, 1e-5), grad=grad)


@needs_liger
def test_liger_rope_layouts_interpreted(interpreted) -> None:
    """The Qwen-VL vision functions (fp32, (seq, heads, dim)) and Llama 4's complex layout through liger."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(10, 2, 16, generator=g), torch.randn(10, 2, 16, generator=g)
    ang = torch.rand(10, 8, generator=g) * 6
    emb = torch.cat((ang, ang), -1)
    vision = RopePatch(op="rope", function="apply_rotary_pos_emb_vision", upcast=True, unsqueeze_dim=-2)
    _vendor_vs_torch("liger", "rope", vision, (q, k, emb.cos(), emb.sin()))
    xq, xk = torch.randn(2, 6, 4, 16, generator=g), torch.randn(2, 6, 2, 16, generator=g)
    complex_patch = RopePatch(op="rope", function="apply_rotary_emb", layout="complex")
    for rows in (1, 2):  # frequencies shared by the batch (liger), per row (the reference)
        ang = torch.rand(rows, 6, 8, generator=g) * 6
        _vendor_vs_torch("liger", "rope", complex_patch, (xq, xk, torch.polar(torch.ones_like(ang), ang)),
                         grad=False)
