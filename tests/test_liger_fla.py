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
import os
from pathlib import Path

import pytest
import torch
import transformers
from conftest import tiny_for

import engine
from engine.errors import DeviceUnsupported
from engine.kernels import registry
from engine.ops.rms_norm import rms_norm_reference
from engine.runtime.hub_functions import hub_binding, torch_body
from engine.schema import CastOrder, LinearAttentionPatch, Precision, RmsNormPatch, RopePatch, Scale, SwigluPatch
from engine.verification import probe_batch
from engine.verification.compare import judge

ROOT = Path(__file__).resolve().parent.parent
HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
HAS_FLA = importlib.util.find_spec("fla") is not None
needs_liger = pytest.mark.skipif(not HAS_LIGER, reason="liger-kernel is not installed (extra: cuda)")
needs_fla = pytest.mark.skipif(not HAS_FLA, reason="flash-linear-attention is not installed (extra: fla)")


@pytest.fixture
def interpreted():
    """Triton kernels launched in the test run on the CPU with Triton's interpreter (engine's shims)."""
    from engine.kernels.triton_interpret import interpreting

    with interpreting():
        yield


def _truth(fn, args):
    """``fn`` on fp64 copies of the float tensors: the judge's truth."""
    return fn(*[a.detach().double() if torch.is_tensor(a) and a.is_floating_point() else a for a in args])


def _run(fn, args, upstream_seed: int = 7):
    """``fn(*args)`` on fresh leaves, and the input gradients for a fixed random upstream gradient."""
    leaves = [a.detach().clone().requires_grad_(a.is_floating_point()) if torch.is_tensor(a) else a for a in args]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    g = torch.Generator().manual_seed(upstream_seed)
    ups = [torch.randn(o.shape, generator=g).to(o.dtype) for o in outs]
    torch.autograd.backward(list(outs), ups)
    grads = tuple(a.grad if torch.is_tensor(a) else None for a in leaves)
    return tuple(o.detach() for o in outs), grads


def assert_as_good(got, want, truth, what: str = "") -> None:
    """The verifier's own criterion: ``got`` within 3x the reference's rounding error of it (or bit-equal)."""
    passed, note = judge(got, want, truth)
    assert passed, f"{what}: {note}"


def _vendor_vs_torch(kernel: str, op: str, patch, args, *, grad: bool = True) -> None:
    """The vendor kernel (interpreted) vs the op's torch reference: outputs, and input gradients in fp32."""
    vendor, ref = registry.get(kernel, op).build(patch), registry.get("torch", op).build(patch)
    if grad and all(not torch.is_tensor(a) or a.dtype in (torch.float32, torch.int64, torch.int32) for a in args):
        (go, gg), (wo, wg) = _run(vendor, args), _run(ref, args)
        assert_as_good(go, wo, _truth(ref, args), f"{kernel} {op} forward")
        assert gg[0] is not None
        for a, b in zip(gg, wg, strict=True):
            if a is not None:  # liger's rope gives no gradient to cos / sin (constants of the model)
                torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-4)
    else:
        with torch.no_grad():
            got = vendor(*[a.clone() if torch.is_tensor(a) else a for a in args])
            want = ref(*[a.clone() if torch.is_tensor(a) else a for a in args])
        assert_as_good(got, want, _truth(ref, args), f"{kernel} {op} forward")


# ---------------------------------------------------------------- liger


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@needs_liger
@DTYPES
@pytest.mark.parametrize(("scale", "cast", "precision"), [
    ("weight", "llama", "native"),            # Llama, Qwen: casting mode llama, offset 0
    ("one_plus_weight", "fp32", "native"),    # Gemma: casting mode gemma, offset 1
    ("weight", "fp32", "native"),             # fp32 cast order: gemma mode, offset 0
    ("one_plus_weight", "llama", "fp32"),     # precision fp32: gemma mode, offset 1
])
def test_liger_rms_norm_interpreted(interpreted, dtype, scale, cast, precision) -> None:
    """Liger's real RMSNorm kernel with our (offset, casting_mode): forward and backward vs the reference."""
    patch = RmsNormPatch(target="X", op="rms_norm", scale=scale, cast=cast, precision=precision)
    assert registry.get("liger", "rms_norm").supports(patch) is None
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 3, 64, generator=g) * 3).to(dtype)
    w = (torch.randn(64, generator=g) * 0.05 + (0.0 if scale == "one_plus_weight" else 1.0)).to(dtype)
    _vendor_vs_torch("liger", "rms_norm", patch, (x, w, 1e-6), grad=dtype is torch.float32)


@needs_liger
def test_liger_rms_norm_casting_mode_none_is_not_ours(interpreted) -> None:
    """Liger's third casting mode ('none': all in the input dtype) is no declared order: we never pass it,
    and in bf16 the real kernel shows why (it differs from both our orders by more than their rounding)."""
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    from engine.kernels.liger import liger_rms_norm_arguments

    modes = {liger_rms_norm_arguments(Scale(s), CastOrder(c), Precision(p))[1]
             for s in ("weight", "one_plus_weight") for c in ("llama", "fp32") for p in ("native", "fp32")}
    assert modes == {"llama", "gemma"}
    g = torch.Generator().manual_seed(1)
    x, w = (torch.randn(4, 64, generator=g) * 3).bfloat16(), (1 + torch.randn(64, generator=g) * 0.1).bfloat16()
    with torch.no_grad():
        none = LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "none", False)
    ref = rms_norm_reference(x, w, 1e-6)
    assert torch.isfinite(none).all() and not torch.equal(none, ref)


@needs_liger
def test_liger_rms_norm_mixed_dtype_runs_reference_and_warns(interpreted) -> None:
    patch = RmsNormPatch(target="X", op="rms_norm", scale="weight", cast="llama")
    x, w = torch.randn(3, 16).bfloat16(), torch.randn(16)  # fp32 weight, bf16 input: transformers returns fp32
    with pytest.warns(UserWarning, match="liger cannot produce"):
        got = registry.get("liger", "rms_norm").build(patch)(x, w, 1e-6)
    assert got.dtype == torch.float32
    assert torch.equal(got, rms_norm_reference(x, w, 1e-6))


@needs_liger
@DTYPES
def test_liger_swiglu_interpreted(interpreted, dtype) -> None:
    g = torch.Generator().manual_seed(2)
    gate, up = (torch.randn(2, 5, 48, generator=g) * 2).to(dtype), torch.randn(2, 5, 48, generator=g).to(dtype)
    _vendor_vs_torch("liger", "swiglu", SwigluPatch(target="X", op="swiglu"), (gate, up), grad=dtype is torch.float32)


@needs_liger
def test_liger_rope_interpreted(interpreted) -> None:
    """liger's rope kernel: full and partial rotary (qwen3_next), forward and backward."""
    for rot in (16, 8):
        g = torch.Generator().manual_seed(rot)
        q, k = torch.randn(2, 4, 6, 16, generator=g), torch.randn(2, 2, 6, 16, generator=g)
        # transformers' layout: cos = cos(cat(freqs, freqs)); liger reads the first half only
        freqs = torch.arange(6.0)[:, None] * (0.5 ** torch.arange(rot // 2.0))[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[None]
        _vendor_vs_torch("liger", "rope", RopePatch(op="rope"), (q, k, emb.cos(), emb.sin()))
    # (batch, seq, heads, dim) with unsqueeze_dim=2 (DeepSeek-V3.2's indexer, on a split of q):
    # liger reads (batch, heads, seq, dim) whatever unsqueeze_dim says; passed as it was, it wrote outside q
    g = torch.Generator().manual_seed(3)
    q_full, k_full = torch.randn(2, 6, 4, 24, generator=g), torch.randn(2, 6, 1, 24, generator=g)
    q, k = q_full[..., :16], k_full[..., :16]
    freqs = torch.arange(6.0)[:, None] * (0.5 ** torch.arange(8.0))[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[None].expand(2, -1, -1)
    _vendor_vs_torch("liger", "rope", RopePatch(op="rope"), (q, k, emb.cos(), emb.sin(), 2))


@needs_liger
def test_liger_flce_interpreted(interpreted) -> None:
    """Liger's fused linear cross-entropy through our mapping: mean, sum / num_items_in_batch, softcap, ignore."""
    from engine.kernels.liger_flce import liger_flce, liger_function_for

    kernel = liger_flce(liger_function_for)
    g = torch.Generator().manual_seed(3)
    hidden, weight = torch.randn(10, 32, generator=g), torch.randn(50, 32, generator=g) * 0.2
    target = torch.randint(0, 50, (10,), generator=g)
    target[3] = -100
    for kwargs in ({}, {"num_items_in_batch": 7}, {"softcap": 5.0}):
        def ref(h, w, kwargs=kwargs):
            logits = h @ w.T
            if "softcap" in kwargs:
                logits = torch.tanh(logits / kwargs["softcap"]) * kwargs["softcap"]
            n = kwargs.get("num_items_in_batch")
            loss = torch.nn.functional.cross_entropy(logits.float(), target, ignore_index=-100,
                                                     reduction="sum" if n else "mean")
            return loss / n if n else loss

        (got,), got_grads = _run(lambda h, w, kwargs=kwargs: kernel(h, w, target, **kwargs), (hidden, weight))
        (want,), want_grads = _run(ref, (hidden, weight))
        assert_as_good(got, want, _truth(ref, (hidden, weight)), str(kwargs))
        for a, b in zip(got_grads, want_grads, strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@needs_liger
def test_liger_flce_with_gradients_in_the_backward_interpreted(interpreted) -> None:
    """The FSDP2 head's path (engine.ops.sharded_head.gradients_in_backward) around liger's kernel:
    the loss and both gradients bit for bit those of liger called directly."""
    from engine.kernels.liger_flce import liger_flce, liger_function_for
    from engine.ops.sharded_head import gradients_in_backward

    kernel = liger_flce(liger_function_for)
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(24, 32, generator=g).requires_grad_()
    weight = (0.3 * torch.randn(300, 32, generator=g)).requires_grad_()
    target = torch.randint(0, 300, (24,), generator=g)
    target[[2, 5]] = -100
    direct = kernel(hidden, weight, target, num_items_in_batch=17)
    want = torch.autograd.grad(direct * 0.7, (hidden, weight))
    deferred = gradients_in_backward(lambda h, w: kernel(h, w, target, num_items_in_batch=17), hidden, weight)
    got = torch.autograd.grad(deferred * 0.7, (hidden, weight))
    assert torch.equal(deferred, direct)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


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


def _fla_vs_torch(rule: str, form: str, t: int, *, grad: bool) -> None:
    """fla's kernel for (rule, form), interpreted, vs transformers' torch path: outputs, state, gradients."""
    patch = LinearAttentionPatch(op="linear_attention", function="f", form=form, rule=rule)
    fla_k, torch_k = (registry.get(n, "linear_attention").build(patch) for n in ("fla", "torch"))
    q, k, v, decay, beta, h0 = _delta_rule_inputs(0, t)
    if rule == "kimi_delta_attention":  # per-channel decay, equal q/k/v heads
        v, beta, h0 = v[:, :, :2], beta[:, :, :2], h0[:, :2]
        decay = -torch.rand(*q.shape, generator=torch.Generator().manual_seed(5))
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def call(kernel):
        def f(q, k, v, g, beta, h0):
            return kernel(q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True, cu_seqlens=None)
        return f

    args = (q, k, v, decay, beta, h0)
    if grad:
        (o1, s1), g1 = _run(call(fla_k), args)
        (o2, s2), g2 = _run(call(torch_k), args)
        for name, a, b in zip(names, g1, g2, strict=True):
            torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-4, msg=name)
    else:
        with torch.no_grad():
            o1, s1 = call(fla_k)(*args)
            o2, s2 = call(torch_k)(*args)
    torch.testing.assert_close(o1, o2, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s1, s2, atol=2e-5, rtol=1e-4)
    assert float(o2.abs().max()) > 0.1  # a real signal, not zeros


@needs_fla
@pytest.mark.parametrize("rule", ["gated_delta_rule", "kimi_delta_attention"])
def test_fla_recurrent_interpreted(interpreted, rule: str) -> None:
    """fla's fused recurrent kernel (decode; no backward) vs transformers' torch path."""
    _fla_vs_torch(rule, "recurrent", 12, grad=False)


@needs_fla
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PATCH_ENGINE_SLOW_INTERPRET"),
                    reason="interpreted, a minute on 2 cores: run by .ci/interpret (PATCH_ENGINE_SLOW_INTERPRET=1)")
@pytest.mark.parametrize("rule", ["gated_delta_rule", "kimi_delta_attention"])
def test_fla_chunk_interpreted(interpreted, monkeypatch, rule: str) -> None:
    """fla's chunk kernel (autotuned: the autotune shim) forward and backward vs the torch chunk path, with
    fp32 dots in full precision (TRITON_F32_DEFAULT=ieee; by default NVIDIA's are TF32: the tf32 shim)."""
    import triton

    monkeypatch.setattr(triton.knobs.language, "fp32_default", "ieee")
    _fla_vs_torch(rule, "chunk", 12, grad=True)


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
def test_with_fla_installed_unpatched_qwen3_5_on_cpu_fails_before_transformers_5_25(qwen3_5) -> None:
    """The transformers behaviour this engine corrects: before 5.25 an unpatched Qwen3.5 called fla's
    Triton kernels on CPU tensors ("active drivers"); since 5.25 transformers checks the device and
    falls back to its torch path itself (the engine's own torch kernel is unchanged either way)."""
    from packaging.version import Version

    if Version(transformers.__version__) >= Version("5.25"):
        with torch.no_grad():
            assert torch.isfinite(qwen3_5(**probe_batch(qwen3_5)).logits).all()
        return
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
@DTYPES
def test_fla_gated_norm_interpreted(interpreted, activation: str, dtype: torch.dtype) -> None:
    """fla's rms_norm_gated (fp32 throughout, one cast) is offered only where that is the declared order,
    and there its real kernel matches the torch reference."""
    from engine.schema import GatedRmsNormPatch

    provider = registry.get("fla", "gated_rms_norm")
    fits = GatedRmsNormPatch(target="X", op="gated_rms_norm", scale="weight", activation=activation,
                             order="norm_then_gate", cast="fp32")
    qnext = fits.model_copy(update={"cast": CastOrder.llama})
    assert provider.supports(fits) is None
    assert "rounds x_hat before the weight multiply" in provider.supports(qnext)
    g = torch.Generator().manual_seed(0)
    x, gate = torch.randn(8, 32, generator=g).to(dtype), torch.randn(8, 32, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(32, generator=g)).to(dtype)
    _vendor_vs_torch("fla", "gated_rms_norm", fits, (x, gate, w, 1e-6, None), grad=dtype is torch.float32)


# ---------------------------------------------------------------- verify --device cuda --interpret


def _norms_only(tmp_path, **change) -> str:
    """qwen3's patchset with its RMSNorm patches only (quick to interpret), with ``change`` applied to them."""
    import yaml

    data = engine.load_patchset("qwen3").model_dump(mode="json", exclude_none=True)
    data["patches"] = [{**p, **change} for p in data["patches"] if p["op"] == "rms_norm"]
    data.pop("files", None)
    path = tmp_path / "norms.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_cli_interpret_refuses_other_devices_and_checkpoints(capsys) -> None:
    from engine.commands.cli import main

    assert main(["verify", "qwen3", "--interpret", "--device", "npu"]) == 2  # nothing to interpret there
    assert "--interpret runs the CUDA plan's Triton kernels on this CPU" in capsys.readouterr().err
    assert main(["verify", "qwen3", "--interpret", "--model", "some/folder"]) == 2
    assert "--interpret verifies on a tiny model" in capsys.readouterr().err


@needs_liger
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PATCH_ENGINE_SLOW_INTERPRET"),
                    reason="interpreted whole verify, ~40 s on 2 cores: run by .ci/interpret")
def test_cli_verify_interpret(tmp_path, capsys) -> None:
    """`verify --interpret`: the CUDA plan (liger in the kernel column) run on this CPU; a flipped scale fails
    it, naming the module (exit 1). The passing case: test_interpreted_verify_passes_and_catches_a_wrong_argument."""
    from engine.commands.cli import main

    assert main(["verify", _norms_only(tmp_path, scale="one_plus_weight", cast="fp32"), "--interpret"]) == 1
    out = capsys.readouterr().out
    assert "on a tiny qwen3 (Qwen3ForCausalLM, cuda)" in out and "verification FAILED" in out, out
    # the table groups the modules by class, op and kernel: the kernel is named in the group's heading
    assert "Qwen3RMSNorm: rms_norm, kernel liger; 9 modules" in out, out
    assert any(line.strip().startswith("model.layers.0.self_attn.q_norm ") and line.rstrip().endswith("FAIL")
               for line in out.splitlines()), out
    assert "does not reproduce Qwen3RMSNorm.forward" in out, out


@needs_liger
def test_interpreted_verify_passes_and_catches_a_wrong_argument(monkeypatch) -> None:
    """engine.verify(..., interpret=True): qwen3's CUDA plan passes; a wrong liger argument (offset 1 for a
    weight scale) fails the kernel check of the module it reaches, while the declaration (torch) passes."""
    from engine.kernels import liger

    model = tiny_for("qwen3")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    options = {"modules": "sample", "check_model": False, "batch": probe_batch(model, batch=1, seq=4)}
    report = engine.verify(model, "qwen3", interpret=True, **options)
    assert report.passed and {c.kernel for c in report.checks if c.what == "kernel"} == {"liger"}
    monkeypatch.setattr(liger, "liger_rms_norm_arguments", lambda scale, cast, precision: (1.0, "llama"))
    report = engine.verify(model, "qwen3", interpret=True, raise_on_failure=False, **options)
    failed = {(c.path, c.what) for c in report.checks if not c.passed}
    assert ("model.norm", "kernel") in failed and not any(what == "declaration" for _, what in failed)
    assert not engine.is_patched(model)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_interpreting_is_scoped() -> None:
    """Nothing of the shims outlives the block: triton's own objects are back, exactly."""
    pytest.importorskip("triton")
    import triton
    from triton.runtime import interpreter
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    from engine.kernels.triton_interpret import SHIMS, interpreting, is_interpreting

    watched = [(JITFunction, "run"), (JITFunction, "__call__"), (interpreter, "_implicit_cvt"), (triton, "jit"),
               (interpreter.InterpreterBuilder, "binary_op"), (interpreter.InterpreterBuilder, "create_dot"),
               (interpreter.ASTTransformer, "visit_For"), (Autotuner, "check_disk_cache"),
               (interpreter.InterpreterBuilder, "create_atomic_rmw")]
    before = [(obj, name, obj.__dict__.get(name)) for obj, name in watched]
    with interpreting():
        assert is_interpreting() and triton.knobs.runtime.interpret
        assert any(obj.__dict__.get(name) is not old for obj, name, old in before)
    assert not is_interpreting() and not triton.knobs.runtime.interpret
    assert all(obj.__dict__.get(name) is old for obj, name, old in before)
    assert len({s.name for s in SHIMS}) == len(SHIMS) and all(s.gap and s.obsolete_when for s in SHIMS)


def test_bf16_atomic_add_interpreted(interpreted) -> None:
    """tl.atomic_add into bf16 (liger's MoE backward): lanes sharing an address and two programs all add, each
    sum rounded to nearest even as on the GPU, a masked-off lane adds nothing; the old values come back
    (bf16_atomic shim)."""
    triton = pytest.importorskip("triton")
    import triton.language as tl

    @triton.jit
    def scatter_add(out_ptr, old_ptr, idx_ptr, val_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        on = offs < N - 1
        old = tl.atomic_add(out_ptr + tl.load(idx_ptr + offs), tl.load(val_ptr + offs), mask=on)
        tl.store(old_ptr + tl.program_id(0) * N + offs, old, mask=on)

    idx = torch.tensor([0, 1, 0, 2, 0, 3, 1, 0], dtype=torch.int32)
    val = torch.randn(8, generator=torch.Generator().manual_seed(0)) * 0.1
    out = torch.randn(4, generator=torch.Generator().manual_seed(1)).bfloat16()
    old = torch.zeros(2, 8, dtype=torch.bfloat16)
    want, want_old = out.clone(), old.clone()
    for program in range(2):  # one program after the other, lanes in order: the interpreter's (valid) schedule
        for lane in range(7):  # lane 7 (address 0 again) is masked off
            want_old[program, lane] = want[idx[lane]]
            want[idx[lane]] = (want[idx[lane]].float() + val[lane].bfloat16().float()).bfloat16()
    scatter_add[(2,)](out, old, idx, val, N=8)
    assert torch.equal(out, want) and torch.equal(old, want_old)


def test_a_nan_is_an_infinite_difference() -> None:
    """A kernel that returns NaN where the original has numbers must fail (max(0.0, nan) is 0.0 in Python)."""
    from engine.verification.compare import max_abs_diff

    nan = float("nan")
    assert max_abs_diff(torch.tensor([1.0, nan]), torch.tensor([1.0, 2.0])) == float("inf")
    assert max_abs_diff(torch.tensor([1.0, nan]), torch.tensor([1.5, nan])) == 0.5  # NaN where the original has one
    passed, _ = judge(torch.tensor([1.0, nan]), torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert not passed
