"""CUDA parity of the liger and fla kernels with the torch references (skipped without CUDA).

Run them all with ``tests/gpu/run_all.sh`` on a GPU machine (a few minutes). Tolerances:
fp32 kernels that reorder reductions or use tensor cores (fla) get a looser bound than the
CPU suite's bit-exact checks; the numbers each test measures are printed on failure.
"""

from __future__ import annotations

import copy
import importlib.util
import itertools

import pytest
import torch
from conftest import tiny_for

import engine
from engine.kernels import registry
from engine.ops.rms_norm import rms_norm_reference
from engine.ops.rope import rope_reference
from engine.ops.swiglu import silu_mul_reference
from engine.schema import CastOrder, LinearAttentionPatch, Precision, RmsNormPatch, Scale
from engine.verification import probe_batch

pytestmark = pytest.mark.cuda
DEV = "cuda"
needs_liger = pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel missing")
needs_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None, reason="flash-linear-attention missing")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1.6e-2)}


@needs_liger
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("scale", "cast", "precision"), list(itertools.product(Scale, CastOrder, Precision)))
def test_liger_rms_norm(dtype, scale, cast, precision) -> None:
    patch = RmsNormPatch(target="X", op="rms_norm", scale=scale, cast=cast, precision=precision)
    provider = registry.get("liger", "rms_norm")
    if provider.supports(patch) is not None:
        pytest.skip(provider.supports(patch))
    g = torch.Generator(device=DEV).manual_seed(0)
    x = (torch.randn(512, 1024, generator=g, device=DEV) * 3).to(dtype).requires_grad_()
    w0 = 0.0 if scale is Scale.one_plus_weight else 1.0
    w = (torch.randn(1024, generator=g, device=DEV) * 0.05 + w0).to(dtype).requires_grad_()
    got = provider.build(patch)(x, w, 1e-6)
    expected = rms_norm_reference(x, w, 1e-6, scale=scale, cast=cast, precision=precision)
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got, expected, **TOL[dtype])
    dy = torch.randn_like(got)
    gx, gw = torch.autograd.grad(got, (x, w), dy)
    ex, ew = torch.autograd.grad(expected, (x, w), dy)
    torch.testing.assert_close(gx, ex, **TOL[dtype])
    torch.testing.assert_close(gw.float(), ew.float(), atol=5e-2 if dtype is torch.bfloat16 else 1e-3, rtol=2e-2)


@needs_liger
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_liger_swiglu_and_rope(dtype) -> None:
    g = torch.Generator(device=DEV).manual_seed(1)
    gate, up = (torch.randn(256, 512, generator=g, device=DEV).to(dtype) for _ in range(2))
    torch.testing.assert_close(registry.get("liger", "swiglu").build(None)(gate, up), silu_mul_reference(gate, up),
                               **TOL[dtype])
    rope = registry.get("liger", "rope").build(None)
    for rot in (64, 16):  # full and partial rotary
        q = torch.randn(2, 8, 32, 64, generator=g, device=DEV).to(dtype)
        k = torch.randn(2, 2, 32, 64, generator=g, device=DEV).to(dtype)
        freqs = torch.arange(32.0, device=DEV)[:, None] * (0.5 ** torch.arange(rot // 2.0, device=DEV))[None, :]
        emb = torch.cat((freqs, freqs), -1)[None]
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        for a, b in zip(rope(q, k, cos, sin), rope_reference(q, k, cos, sin), strict=True):
            torch.testing.assert_close(a, b, **TOL[dtype])


def _delta_inputs(t: int, dtype: torch.dtype, grad: bool):
    g = torch.Generator(device=DEV).manual_seed(t)
    b, hk, hv, d = 2, 2, 4, 64
    q = torch.randn(b, t, hk, d, generator=g, device=DEV).to(dtype)
    k = torch.randn(b, t, hk, d, generator=g, device=DEV).to(dtype)
    v = torch.randn(b, t, hv, d, generator=g, device=DEV).to(dtype)
    decay = -torch.rand(b, t, hv, generator=g, device=DEV)
    beta = torch.rand(b, t, hv, generator=g, device=DEV).sigmoid().to(dtype)
    h0 = torch.randn(b, hv, d, d, generator=g, device=DEV) * 0.1
    tensors = [q, k, v, decay, beta]
    if grad:
        for x in tensors:
            x.requires_grad_()
    return tensors, h0


@needs_fla
@pytest.mark.parametrize("form", ["chunk", "recurrent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_gated_delta_rule(form, dtype) -> None:
    patch = LinearAttentionPatch(op="linear_attention", function="f", form=form)
    fla_k, torch_k = (registry.get(n, "linear_attention").build(patch) for n in ("fla", "torch"))
    t = 130 if form == "chunk" else 1
    (q, k, v, decay, beta), h0 = _delta_inputs(t, dtype, grad=(form == "chunk"))
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o1, s1 = fla_k(q, k, v, g=decay, beta=beta, **kw)
    o2, s2 = torch_k(q, k, v, g=decay, beta=beta, **kw)
    tol = dict(atol=2e-3, rtol=2e-3) if dtype is torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(o1, o2, **tol)
    torch.testing.assert_close(s1.float(), s2.float(), **tol)
    if form == "chunk":  # the backward through fla's chunk kernel
        do = torch.randn_like(o1)
        g1 = torch.autograd.grad(o1, (q, k, v, decay, beta), do)
        g2 = torch.autograd.grad(o2, (q, k, v, decay, beta), do)
        for a, b in zip(g1, g2, strict=True):
            torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2)


@needs_fla
def test_fla_recurrent_with_grad_uses_chunk_backward() -> None:
    patch = LinearAttentionPatch(op="linear_attention", function="f", form="recurrent")
    (q, k, v, decay, beta), h0 = _delta_inputs(1, torch.float32, grad=True)
    out, _ = registry.get("fla", "linear_attention").build(patch)(q, k, v, g=decay, beta=beta, initial_state=h0)
    out.sum().backward()  # fla's fused recurrent kernel would raise NotImplementedError here
    assert q.grad is not None and torch.isfinite(q.grad).all()


def _train_step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.logits.float(), out.loss.float(), {n: p.grad.float() for n, p in model.named_parameters()
                                                  if p.grad is not None}


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5_text", "qwen3_next", "gemma", "phi3", "nemotron", "llama4",
                                  "qwen2_vl"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_model_on_cuda_auto(name, dtype) -> None:
    """auto on CUDA (liger / fla where installed) vs the unpatched model on transformers' torch path."""
    reference = tiny_for(name, dtype=dtype).to(DEV)
    patched = copy.deepcopy(reference)
    report = engine.apply(patched, name, device="cuda")
    print(report)
    batch = probe_batch(reference, seq=64)
    with engine.torch_path(reference):
        ref = _train_step(reference, batch)
    got = _train_step(patched, batch)
    tol = dict(atol=2e-3, rtol=2e-3) if dtype is torch.float32 else dict(atol=1e-1, rtol=5e-2)
    torch.testing.assert_close(got[0], ref[0], **tol)
    torch.testing.assert_close(got[1], ref[1], **tol)
    assert got[2].keys() == ref[2].keys()
    worst = max(float((got[2][n] - ref[2][n]).abs().max()) for n in ref[2])
    assert worst < (5e-3 if dtype is torch.float32 else 2e-1), worst


@pytest.mark.parametrize("name", ["qwen3_5_text"])
def test_generate_on_cuda_matches_torch_path(name) -> None:
    reference = tiny_for(name).to(DEV)
    patched = copy.deepcopy(reference)
    engine.apply(patched, name, device="cuda")
    ids = probe_batch(reference, batch=1, seq=8)["input_ids"]
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = patched.generate(ids, **kwargs)
        with engine.torch_path(reference):
            expected = reference.generate(ids, **kwargs)
    assert torch.equal(got, expected)


@needs_fla
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_gated_norm(activation, dtype) -> None:
    pytest.importorskip("engine.ops.gated_rms_norm", reason="the gated_rms_norm op (issue 3) is not merged")
    from engine.schema import GatedRmsNormPatch

    patch = GatedRmsNormPatch(target="X", op="gated_rms_norm", scale="weight", activation=activation,
                              order="norm_then_gate", cast="fp32")
    g = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn(512, 128, generator=g, device=DEV).to(dtype)
    gate = torch.randn(512, 128, generator=g, device=DEV).to(dtype)
    w = (1 + 0.1 * torch.randn(128, generator=g, device=DEV)).to(dtype)
    got = registry.get("fla", "gated_rms_norm").build(patch)(x, gate, w, 1e-6, None)
    expected = registry.get("torch", "gated_rms_norm").build(patch)(x, gate, w, 1e-6, None)
    torch.testing.assert_close(got, expected, **TOL[dtype])


@needs_liger
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_liger_geglu_layer_norm_and_rope_layouts(dtype) -> None:
    """geglu, layer_norm (with and without bias, 1 + w), vision rope (fp32) and Llama 4's complex rope."""
    from engine.schema import GegluPatch, LayerNormPatch, RopePatch

    g = torch.Generator(device=DEV).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=DEV).to(dtype).requires_grad_()

    def both(op, patch, *args):
        outs = []
        for name in ("liger", "torch"):
            leaves = [a.detach().clone().requires_grad_() if torch.is_tensor(a) and a.is_floating_point() else a
                      for a in args]
            out = registry.get(name, op).build(patch)(*leaves)
            out = out if isinstance(out, tuple) else (out,)
            sum(o.float().pow(2).sum() for o in out).backward()
            grads = [a.grad for a in leaves if torch.is_tensor(a) and a.grad is not None]
            outs.append([o.detach() for o in out] + grads)
        for a, b in zip(*outs, strict=True):
            torch.testing.assert_close(a.float(), b.float(), **TOL[dtype])

    both("geglu", GegluPatch(target="X", op="geglu"), rand(64, 256), rand(64, 256))
    for scale, bias in (("weight", rand(256)), ("weight", None), ("one_plus_weight", rand(256))):
        patch = LayerNormPatch(target="X", op="layer_norm", scale=scale)
        both("layer_norm", patch, rand(64, 256), rand(256), bias, 1e-6)
    angles = torch.rand(96, 32, device=DEV) * 6
    emb = torch.cat((angles, angles), -1)
    vision = RopePatch(op="rope", function="apply_rotary_pos_emb_vision", upcast=True, unsqueeze_dim=-2)
    both("rope", vision, rand(96, 4, 64), rand(96, 4, 64), emb.cos().to(dtype), emb.sin().to(dtype))
    ang = torch.rand(1, 48, 32, device=DEV) * 6
    both("rope", RopePatch(op="rope", function="apply_rotary_emb", layout="complex"), rand(2, 48, 4, 64),
         rand(2, 48, 2, 64), torch.polar(torch.ones_like(ang), ang))
