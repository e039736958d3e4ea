"""liger and fla providers on a CPU, and Qwen3-Next / Qwen3.5 linear attention routed per device.

Where a vendor kernel runs under Triton's CPU interpreter (liger's rope, fla's fused
recurrent gated delta rule) it is run, in a subprocess with ``TRITON_INTERPRET=1`` set before
triton is imported. Where it does not (liger RMSNorm / SiLU-mul, fla chunk), the argument
mapping is tested at the call boundary and the numbers on CUDA (tests/gpu). Tests skip with
a reason when the package is not installed, so the suite passes without them.
"""

from __future__ import annotations

import copy
import importlib.util
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import tiny_for

import engine
from engine.errors import DeviceUnsupported
from engine.hub_functions import hub_binding, torch_body
from engine.kernels import registry
from engine.ops.rms_norm import rms_norm_reference
from engine.schema import CastOrder, LinearAttentionPatch, Precision, RmsNormPatch, Scale
from engine.verification import probe_batch

ROOT = Path(__file__).resolve().parent.parent
HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
HAS_FLA = importlib.util.find_spec("fla") is not None
needs_liger = pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel is not installed (extra: cuda)")
needs_fla = pytest.mark.skipif(not HAS_FLA, reason="flash-linear-attention is not installed (extra: fla)")


def _interpret(script: str) -> dict:
    """Run ``script`` in a fresh interpreter with TRITON_INTERPRET=1; it prints one JSON line."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- liger


def _liger_documented(x, w, eps, offset, mode):
    """What liger's RMSNorm kernel computes for (offset, casting_mode), from its source comments."""
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if mode == "gemma":  # everything in fp32, cast at the end
        return (xf * rstd * (offset + w.float())).to(x.dtype)
    # llama: only rstd in fp32; x_hat cast to the input dtype, then the (fp32) weight multiply, stored as x.dtype
    return ((xf * rstd).to(x.dtype).float() * (offset + w.float())).to(x.dtype)


@needs_liger
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scale", list(Scale))
@pytest.mark.parametrize("cast", list(CastOrder))
@pytest.mark.parametrize("precision", list(Precision))
def test_liger_rms_norm_call_boundary(monkeypatch, dtype, scale, cast, precision) -> None:
    """Our (scale, cast, precision) -> liger's (offset, casting_mode, in_place=False), and its numbers."""
    from liger_kernel.ops import rms_norm as liger_rms

    calls = []

    def fake_apply(x, w, eps, offset, mode, in_place):
        calls.append((offset, mode, in_place))
        return _liger_documented(x, w, eps, offset, mode)

    monkeypatch.setattr(liger_rms.LigerRMSNormFunction, "apply", staticmethod(fake_apply))
    patch = RmsNormPatch(target="X", op="rms_norm", scale=scale, cast=cast, precision=precision)
    provider = registry.get("liger", "rms_norm")
    unfit = provider.supports(patch)
    if unfit is not None:  # (1 + w) in the llama order: auto never picks liger
        assert scale is Scale.one_plus_weight and cast is CastOrder.llama and precision is Precision.native
        return
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(4, 64, generator=gen) * 3).to(dtype)
    w = (torch.randn(64, generator=gen) * 0.05 + (0.0 if scale is Scale.one_plus_weight else 1.0)).to(dtype)
    got = provider.build(patch)(x, w, 1e-6)
    expected_mode = "llama" if (cast is CastOrder.llama and precision is Precision.native) else "gemma"
    assert calls == [(1.0 if scale is Scale.one_plus_weight else 0.0, expected_mode, False)]
    expected = rms_norm_reference(x, w, 1e-6, scale=scale, cast=cast, precision=precision)
    assert got.dtype == expected.dtype
    assert torch.equal(got, expected)


@needs_liger
def test_liger_rms_norm_mixed_dtype_runs_reference_and_warns(monkeypatch) -> None:
    from liger_kernel.ops import rms_norm as liger_rms

    monkeypatch.setattr(liger_rms.LigerRMSNormFunction, "apply", staticmethod(lambda *a: pytest.fail("liger called")))
    patch = RmsNormPatch(target="X", op="rms_norm", scale="weight", cast="llama")
    x, w = torch.randn(3, 16).bfloat16(), torch.randn(16)  # fp32 weight, bf16 input: transformers returns fp32
    with pytest.warns(UserWarning, match="liger cannot produce"):
        got = registry.get("liger", "rms_norm").build(patch)(x, w, 1e-6)
    assert got.dtype == torch.float32
    assert torch.equal(got, rms_norm_reference(x, w, 1e-6))


@needs_liger
def test_liger_swiglu_call_boundary(monkeypatch) -> None:
    from liger_kernel.ops import swiglu as liger_swiglu

    seen = []
    monkeypatch.setattr(liger_swiglu.LigerSiLUMulFunction, "apply",
                        staticmethod(lambda a, b: seen.append((a, b)) or torch.nn.functional.silu(a) * b))
    gate, up = torch.randn(2, 8), torch.randn(2, 8)
    registry.get("liger", "swiglu").build(None)(gate, up)
    assert seen[0][0] is gate and seen[0][1] is up


@needs_liger
def test_liger_rope_under_triton_interpreter() -> None:
    """liger's rope kernel, run by Triton's CPU interpreter: full and partial rotary, forward and backward."""
    out = _interpret(
        """
        import json, torch
        from engine.kernels import registry
        from engine.ops.rope import rope_reference
        rope = registry.get("liger", "rope").build(None)
        result = {}
        for rot in (16, 8):  # full, and qwen3_next's partial rotary
            g = torch.Generator().manual_seed(rot)
            q = torch.randn(2, 4, 6, 16, generator=g, requires_grad=True)
            k = torch.randn(2, 2, 6, 16, generator=g, requires_grad=True)
            # transformers' layout: cos = cos(cat(freqs, freqs)); liger reads the first half only
            freqs = torch.arange(6.0)[:, None] * (0.5 ** torch.arange(rot // 2.0))[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)[None]
            cos, sin = emb.cos(), emb.sin()
            got = rope(q, k, cos, sin)
            (got[0].sum() + (got[1] * 2).sum()).backward()
            gq, gk = q.grad.clone(), k.grad.clone()
            q.grad = k.grad = None
            ref = rope_reference(q, k, cos, sin)
            (ref[0].sum() + (ref[1] * 2).sum()).backward()
            result[rot] = max(float((a - b).abs().max()) for a, b in
                              [(got[0], ref[0]), (got[1], ref[1]), (gq, q.grad), (gk, k.grad)])
        print(json.dumps(result))
        """
    )
    assert out["16"] < 1e-5 and out["8"] < 1e-5, out


# ---------------------------------------------------------------- fla and the linear attention


def _delta_rule_inputs(seed: int, t: int, requires_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    b, hk, hv, d = 1, 2, 4, 16  # grouped value heads, as Qwen3-Next
    q, k = torch.randn(b, t, hk, d, generator=g), torch.randn(b, t, hk, d, generator=g)
    v = torch.randn(b, t, hv, d, generator=g)
    decay = -torch.rand(b, t, hv, generator=g)  # log space, <= 0
    beta = torch.rand(b, t, hv, generator=g).sigmoid()
    state = torch.randn(b, hv, d, d, generator=g) * 0.1
    return q, k, v, decay, beta, state


@needs_fla
def test_fla_recurrent_matches_torch_under_triton_interpreter() -> None:
    """fla's fused recurrent gated delta rule (our fla kernel, form: recurrent) vs transformers' torch path."""
    out = _interpret(
        """
        import json, torch
        from engine.kernels import registry
        from engine.schema import LinearAttentionPatch
        patch = LinearAttentionPatch(op="linear_attention", function="f", form="recurrent")  # gated_delta_rule
        fla_k, torch_k = (registry.get(n, "linear_attention").build(patch) for n in ("fla", "torch"))
        g = torch.Generator().manual_seed(0)
        b, t, hk, hv, d = 1, 40, 2, 4, 16
        q, k = torch.randn(b, t, hk, d, generator=g), torch.randn(b, t, hk, d, generator=g)
        v = torch.randn(b, t, hv, d, generator=g)
        decay, beta = -torch.rand(b, t, hv, generator=g), torch.rand(b, t, hv, generator=g).sigmoid()
        h0 = torch.randn(b, hv, d, d, generator=g) * 0.1
        kw = dict(g=decay, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                  cu_seqlens=None)
        with torch.no_grad():
            o1, s1 = fla_k(q, k, v, **kw)
            o2, s2 = torch_k(q, k, v, **kw)
        print(json.dumps({"out": float((o1 - o2).abs().max()), "state": float((s1 - s2).abs().max()),
                          "scale": float(o2.abs().max())}))
        """
    )
    assert out["out"] < 1e-5 and out["state"] < 1e-5, out
    assert out["scale"] > 0.1  # a real signal, not zeros


def test_torch_delta_rule_refuses_packed_sequences() -> None:
    patch = LinearAttentionPatch(op="linear_attention", function="f", form="chunk")
    q, k, v, decay, beta, _ = _delta_rule_inputs(0, 5)
    with pytest.raises(ValueError, match="cannot keep packed sequences") as info:
        registry.get("torch", "linear_attention").build(patch)(q, k, v, g=decay, beta=beta,
                                                                 cu_seqlens=torch.tensor([0, 2, 5]))
    assert isinstance(info.value, engine.PatchError)  # ours (InvalidArgument), and a ValueError


@pytest.mark.parametrize("rule", ["gated_delta_rule", "kimi_delta_attention"])
def test_torch_chunk_and_recurrent_forms_agree(rule: str) -> None:
    """Both forms compute one recurrence (the premise of fla's chunk fallback for gradients)."""
    kernels = {f: registry.get("torch", "linear_attention").build(
        LinearAttentionPatch(op="linear_attention", function="f", form=f, rule=rule)) for f in ("chunk", "recurrent")}
    q, k, v, decay, beta, h0 = _delta_rule_inputs(3, 9)
    if rule == "kimi_delta_attention":  # per-channel decay, equal q/k/v heads
        g = torch.Generator().manual_seed(4)
        v = v[:, :, :2]
        decay = -torch.rand(*q.shape, generator=g)
        beta, h0 = beta[:, :, :2], h0[:, :2]
    kw = dict(g=decay, beta=beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    (o1, s1), (o2, s2) = kernels["chunk"](q, k, v, **kw), kernels["recurrent"](q, k, v, **kw)
    torch.testing.assert_close(o1, o2, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(s1, s2, atol=1e-5, rtol=1e-4)


def test_reference_bodies_are_identical_across_families() -> None:
    """The op takes its ground truth from modeling_qwen3_next; qwen3_5(_moe) must hold the same bodies."""
    from transformers.models.qwen3_5 import modeling_qwen3_5
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe
    from transformers.models.qwen3_next import modeling_qwen3_next

    for name in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        sources = {inspect.getsource(torch_body(getattr(m, name)))
                   for m in (modeling_qwen3_next, modeling_qwen3_5, modeling_qwen3_5_moe)}
        assert len(sources) == 1, name


def test_hub_binding_is_recognised() -> None:
    """Pins how transformers binds the function (closure names) against the installed version."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    binding = hub_binding(m.torch_chunk_gated_delta_rule)
    assert binding is not None
    torch_fn, impl = binding
    assert torch_fn.__name__ == "torch_chunk_gated_delta_rule" and torch_fn.__module__ == m.__name__
    if HAS_FLA:
        assert impl.__module__.startswith("fla.")
    else:
        assert impl is torch_fn


def test_fla_kernel_on_cpu_is_a_device_error(qwen3_5) -> None:
    from snapshots import assert_same, snapshot

    ps = engine.load_patchset("qwen3_5_text").model_dump(mode="json")
    for p in ps["patches"]:
        if p["op"] == "linear_attention":
            p["kernel"] = "fla"
    before = snapshot(qwen3_5)
    with pytest.raises(DeviceUnsupported, match=r"^fla requires cuda or npu, current accelerator is cpu\.$"):
        engine.apply(qwen3_5, ps, device="cpu")
    assert_same(before, snapshot(qwen3_5))


@pytest.fixture
def qwen3_5() -> torch.nn.Module:
    return tiny_for("qwen3_5_text")


def test_auto_on_cpu_keeps_linear_attention_on_torch(qwen3_5) -> None:
    report = engine.apply(qwen3_5, "qwen3_5_text", device="cpu")
    la = [d for d in report.decisions if d.op == "linear_attention"]
    assert len(la) == 2 and {d.kernel for d in la} == {"torch"}
    assert all(d.reason.startswith("auto: first available for cpu") for d in la)
    with torch.no_grad():
        assert torch.isfinite(qwen3_5(**probe_batch(qwen3_5)).logits).all()


@needs_fla
def test_with_fla_installed_unpatched_qwen3_5_fails_on_cpu(qwen3_5) -> None:
    """The transformers behaviour this engine corrects (if this starts passing, transformers fixed it)."""
    with pytest.raises(RuntimeError, match="active drivers"), torch.no_grad():
        qwen3_5(**probe_batch(qwen3_5))


def _step(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    out.loss.backward()
    return out.logits.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_text"])
def test_patched_on_cpu_trains_and_matches_the_torch_path(name: str) -> None:
    """Forward and backward of the patched model on CPU == the unpatched model on transformers' torch path."""
    reference = tiny_for(name)
    patched = copy.deepcopy(reference)
    engine.apply(patched, name, device="cpu")
    batch = probe_batch(reference, seq=20)
    with engine.torch_path(reference) as rerouted:
        ref_logits, ref_grads = _step(reference, batch)
    assert bool(rerouted) == HAS_FLA  # rerouted exactly when transformers bound the functions to fla
    got_logits, got_grads = _step(patched, batch)
    assert torch.equal(got_logits, ref_logits)
    assert got_grads.keys() == ref_grads.keys() and any("linear_attn" in k for k in got_grads)
    for key in ref_grads:
        if ".mlp.experts." in key:  # moe_experts (grouped_mm) vs transformers' grouped_mm: another sum order
            torch.testing.assert_close(got_grads[key], ref_grads[key], rtol=1e-5, atol=1e-7, msg=key)
        else:
            assert torch.equal(got_grads[key], ref_grads[key]), key


def test_patched_decode_on_cpu_uses_the_recurrent_torch_path(qwen3_5) -> None:
    """generate() reaches the recurrent rule (cached decode); patched == unpatched torch path, token for token."""
    reference = copy.deepcopy(qwen3_5)
    engine.apply(qwen3_5, "qwen3_5_text", device="cpu")
    ids = probe_batch(qwen3_5, batch=1, seq=6)["input_ids"]
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        got = qwen3_5.generate(ids, **kwargs)
        with engine.torch_path(reference):
            expected = reference.generate(ids, **kwargs)
    assert torch.equal(got, expected)


@needs_fla
@pytest.mark.parametrize("activation", ["silu", "sigmoid"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_gated_norm_call_boundary(monkeypatch, activation: str, dtype: torch.dtype) -> None:
    """fla's rms_norm_gated (fp32 throughout, one cast) is offered only where that is the declared order."""
    pytest.importorskip("engine.ops.gated_rms_norm", reason="the gated_rms_norm op (issue 3) is not merged")
    from fla.modules.norm import fused_norm_gate

    from engine.schema import GatedRmsNormPatch

    def documented(x, g, weight, bias, activation="swish", residual=None, prenorm=False, residual_in_fp32=False,
                   eps=1e-6):  # the kernel in fused_norm_gate.py: fp32 math, weight in fp32, cast at the store
        assert bias is None and residual is None
        xf, gf = x.float(), g.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
        y = y * gf * torch.sigmoid(gf) if activation == "swish" else y * torch.sigmoid(gf)
        return y.to(x.dtype)

    monkeypatch.setattr(fused_norm_gate, "rms_norm_gated", documented)
    provider = registry.get("fla", "gated_rms_norm")
    fits = GatedRmsNormPatch(target="X", op="gated_rms_norm", scale="weight", activation=activation,
                             order="norm_then_gate", cast="fp32")
    qnext = fits.model_copy(update={"cast": CastOrder.llama})
    assert provider.supports(fits) is None
    assert "rounds x_hat before the weight multiply" in provider.supports(qnext)
    g = torch.Generator().manual_seed(0)
    x, gate = torch.randn(8, 32, generator=g).to(dtype), torch.randn(8, 32, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(32, generator=g)).to(dtype)
    got = provider.build(fits)(x, gate, w, 1e-6, None)
    expected = registry.get("torch", "gated_rms_norm").build(fits)(x, gate, w, 1e-6, None)
    assert got.dtype == expected.dtype
    # fla forms silu as g * sigmoid(g): an fp32 ulp from F.silu, invisible after the bf16 cast
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
