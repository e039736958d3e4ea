"""The ``npu`` provider against an emulator of torch_npu's documented op contracts (no NPU here).

The emulator (tests/npu_emulator.py) is injected as the ``torch_npu`` module; plans are made
for ``device="npu"`` while tensors stay on the CPU. Real-NPU runs are not part of CI: what is
proven here is the argument mapping and the rounding order, given the emulator's stated
assumption that each fused op computes in fp32 and rounds once.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_for

import engine
from engine.kernels.npu import npu_rms_norm_kernel
from engine.loader import load_patchset
from engine.ops.rms_norm import rms_norm_reference
from engine.schema import CastOrder, Precision, Scale
from engine.verification import probe_batch


def _patchset(name: str, ops: set[str]) -> dict:
    """The bundled patchset restricted to ``ops``, every patch on the npu kernel.

    The linear attention (if any) stays on torch: fla (auto's next choice on npu) needs a device.
    """
    data = load_patchset(name).model_dump(mode="json", exclude_none=True)
    patches = []
    for p in data["patches"]:
        if p["op"] in ops:
            patches.append({**p, "kernel": {"npu": "npu"}})
        elif p["op"] == "linear_attention":
            patches.append({**p, "kernel": "torch"})
    return {**data, "name": f"{name}-npu", "patches": patches, "extends": None}

def _run(model: torch.nn.Module, batch: dict[str, torch.Tensor]):
    model.zero_grad(set_to_none=True)
    with engine.torch_path(model):  # a no-op unless fla is installed (then: the torch delta rule on CPU)
        out = model(**batch)
    out.loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads

def _patched_and_reference(name: str, dtype: torch.dtype, ops: set[str]):
    reference = tiny_for(name, dtype=dtype)
    patched = copy.deepcopy(reference)
    report = engine.apply(patched, _patchset(name, ops), device="npu")
    npu_ops = {d.op for d in report.decisions if d.kernel == "npu"}
    assert npu_ops == ops, report
    batch = probe_batch(reference, seq=12)
    return _run(patched, batch), _run(reference, batch)

FAMILIES = [("qwen3", "weight, llama order"), ("qwen3_5_text", "1 + weight, fp32 order")]

@pytest.mark.parametrize("name", [f for f, _ in FAMILIES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_npu_rms_norm_is_bit_exact(torch_npu, name: str, dtype: torch.dtype) -> None:
    """npu_rms_norm with the arguments our provider chooses rounds exactly where transformers does."""
    pat, ref = _patched_and_reference(name, dtype, {"rms_norm"})
    assert "npu_rms_norm" in torch_npu.calls
    assert torch.equal(pat[0], ref[0]) and torch.equal(pat[1], ref[1])
    assert pat[2].keys() == ref[2].keys() and ref[2]
    for k in ref[2]:
        assert torch.equal(pat[2][k], ref[2][k]), k

@pytest.mark.parametrize("name", [f for f, _ in FAMILIES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_npu_full_patchset_matches(torch_npu, name: str, dtype: torch.dtype) -> None:
    """Norms, swiglu and rope on the npu kernels: within one rounding of the input dtype."""
    pat, ref = _patched_and_reference(name, dtype, {"rms_norm", "swiglu", "rope"})
    assert {"npu_rms_norm", "npu_swiglu", "npu_rotary_mul"} <= set(torch_npu.calls)
    # swiglu and rope round once in the fused op where torch rounds after every step
    atol, rtol = (1e-5, 1e-5) if dtype is torch.float32 else (6e-2, 2e-2)
    torch.testing.assert_close(pat[0], ref[0], atol=atol, rtol=rtol)
    torch.testing.assert_close(pat[1], ref[1], atol=atol, rtol=rtol)
    for k in ref[2]:
        torch.testing.assert_close(pat[2][k].float(), ref[2][k].float(), atol=max(atol, 1e-4), rtol=max(rtol, 1e-3) if
                                   dtype is torch.float32 else 0.25, msg=k)

CASES = [
    (scale, cast, precision, xd, wd)
    for scale in Scale
    for cast in CastOrder
    for precision in Precision
    for xd in (torch.float32, torch.bfloat16)
    for wd in (torch.float32, torch.bfloat16)
]

@pytest.mark.parametrize(("scale", "cast", "precision", "x_dtype", "w_dtype"), CASES)
def test_npu_rms_norm_every_setting_is_exact(torch_npu, scale, cast, precision, x_dtype, w_dtype) -> None:
    """Every scale x cast order x precision x dtype pair: bit-equal to the reference, same dtype."""
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, 64, generator=gen) * 3).to(x_dtype)
    w = (torch.randn(64, generator=gen) * 0.05 + (0.0 if scale is Scale.one_plus_weight else 1.0)).to(w_dtype)
    kernel = npu_rms_norm_kernel(torch_npu, scale, cast, precision)
    got = kernel(x, w, 1e-6)
    expected = rms_norm_reference(x, w, 1e-6, scale=scale, cast=cast, precision=precision)
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected)

def test_npu_rope_partial_rotary_and_unsqueeze(torch_npu) -> None:
    """Partial rotary (qwen3_next/qwen3_5: cos narrower than the head) passes the tail through."""
    from engine.kernels import registry
    from engine.ops.rope import rope_reference

    gen = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, 6, 16, generator=gen), torch.randn(2, 2, 6, 16, generator=gen)
    cos, sin = torch.randn(2, 6, 8, generator=gen), torch.randn(2, 6, 8, generator=gen)
    rope = registry.get("npu", "rope").build(None)
    for got, expected in zip(rope(q, k, cos, sin), rope_reference(q, k, cos, sin), strict=True):
        torch.testing.assert_close(got, expected)
    assert torch.equal(rope(q, k, cos, sin)[0][..., 8:], q[..., 8:])

def test_npu_swiglu_concatenates_gate_then_up(torch_npu) -> None:
    from engine.kernels import registry

    gate, up = torch.randn(3, 10), torch.randn(3, 10)
    got = registry.get("npu", "swiglu").build(None)(gate, up)
    torch.testing.assert_close(got, torch.nn.functional.silu(gate) * up)
    assert not torch.allclose(got, torch.nn.functional.silu(up) * gate)  # the order matters

gated = pytest.importorskip  # alias, used below only when the gated op exists

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cast", list(CastOrder))
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
def test_npu_gated_norm_is_exact(torch_npu, dtype: torch.dtype, cast: CastOrder, activation: str) -> None:
    """npu_rms_norm then act(gate) in fp32: bit-equal to the gated reference (G_QNEXT, G_F32W_*)."""
    ops = pytest.importorskip("engine.ops.gated_rms_norm", reason="the gated_rms_norm op (issue 3) is not merged")
    from engine.kernels import registry
    from engine.schema import GatedRmsNormPatch

    patch = GatedRmsNormPatch(target="X", op="gated_rms_norm", scale="weight", activation=activation,
                              order="norm_then_gate", cast=cast)
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(7, 32, generator=gen) * 2).to(dtype)
    gate = torch.randn(7, 32, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(32, generator=gen)).to(dtype)
    got = registry.get("npu", "gated_rms_norm").build(patch)(x, gate, w, 1e-6, None)
    expected = registry.get("torch", "gated_rms_norm").build(patch)(x, gate, w, 1e-6, None)
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected)
    assert ops.GatedRmsNormOp.name == "gated_rms_norm"

def test_npu_gated_norm_on_qwen3_5_model(torch_npu) -> None:
    """The Qwen3.5 gated output norm of the linear attention, patched with npu: exact vs unpatched (bf16)."""
    pytest.importorskip("engine.ops.gated_rms_norm", reason="the gated_rms_norm op (issue 3) is not merged")
    pat, ref = _patched_and_reference("qwen3_5_text", torch.bfloat16, {"gated_rms_norm"})
    assert torch.equal(pat[0], ref[0]) and torch.equal(pat[1], ref[1])
