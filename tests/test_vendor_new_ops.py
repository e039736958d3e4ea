"""npu and liger providers of geglu, layer_norm and the rope layouts, on a CPU.

npu: against the emulator of torch_npu's documented contracts (tests/npu_emulator.py),
whole families included (gemma's GeGLU, GLM's interleaved rope, Qwen2-VL's vision rope).
liger: the kernels run under Triton's CPU interpreter in a subprocess where they can; the
layouts liger has no kernel for are passed over by ``auto`` with the reason in the plan.
"""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from conftest import tiny_for
from test_liger_fla import _interpret

import engine
from engine.kernels import registry
from engine.schema import GegluPatch, LayerNormPatch, RopePatch
from engine.verification import probe_batch

HAS_LIGER = importlib.util.find_spec("liger_kernel") is not None
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
def test_liger_kernels_under_triton_interpreter() -> None:
    """geglu, layer_norm, vision rope and Llama 4's complex rope through liger's Triton kernels."""
    out = _interpret(
        """
        import json, torch
        from engine.kernels import registry
        from engine.schema import Device, GegluPatch, LayerNormPatch, RopePatch
        res = {}
        def diff(a, b):
            return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))
        def run(name, op, patch, args):
            want = registry.get("torch", op).build(patch)(*args)
            try:  # on clones: liger's rope rotates contiguous inputs in place
                got = registry.get("liger", op).build(patch)(*[a.clone() if torch.is_tensor(a) else a for a in args])
            except Exception as exc:  # a kernel Triton's interpreter cannot run
                res[name] = f"skip: {type(exc).__name__}: {str(exc)[:120]}"
                return
            got = got if isinstance(got, tuple) else (got,)
            want = want if isinstance(want, tuple) else (want,)
            res[name] = diff(got, want)
        g = torch.Generator().manual_seed(0)
        gate, up = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)
        run("geglu", "geglu", GegluPatch(target="X", op="geglu"), (gate, up))
        x, w, b = torch.randn(4, 32, generator=g), torch.randn(32, generator=g), torch.randn(32, generator=g)
        run("layer_norm", "layer_norm", LayerNormPatch(target="X", op="layer_norm"), (x, w, b, 1e-6))
        run("layer_norm_no_bias", "layer_norm", LayerNormPatch(target="X", op="layer_norm"), (x, w, None, 1e-6))
        q, k = torch.randn(10, 2, 16, generator=g), torch.randn(10, 2, 16, generator=g)
        ang = torch.rand(10, 8, generator=g) * 6
        emb = torch.cat((ang, ang), -1)
        vision = RopePatch(op="rope", function="apply_rotary_pos_emb_vision", upcast=True, unsqueeze_dim=-2)
        run("vision_rope", "rope", vision, (q, k, emb.cos(), emb.sin()))
        xq, xk = torch.randn(2, 6, 4, 16, generator=g), torch.randn(2, 6, 2, 16, generator=g)
        complex_patch = RopePatch(op="rope", function="apply_rotary_emb", layout="complex")
        for name, rows in (("complex_rope", 1), ("complex_rope_per_row", 2)):  # per-row: liger cannot, reference
            ang = torch.rand(rows, 6, 8, generator=g) * 6
            run(name, "rope", complex_patch, (xq, xk, torch.polar(torch.ones_like(ang), ang)))
        print(json.dumps(res))
        """
    )
    ran = {k: v for k, v in out.items() if not isinstance(v, str)}
    assert ran, out  # at least one liger kernel ran under the interpreter
    for name, err in ran.items():
        assert err < 1e-4, (name, out)


@needs_liger
def test_liger_geglu_and_layer_norm_call_boundary(monkeypatch) -> None:
    """Triton's interpreter cannot run these two kernels; the arguments they get are checked here."""
    from liger_kernel.ops import geglu as liger_geglu
    from liger_kernel.ops import layer_norm as liger_layer_norm

    seen: list[tuple] = []
    monkeypatch.setattr(liger_geglu.LigerGELUMulFunction, "apply",
                        staticmethod(lambda a, b: seen.append((a, b)) or a * b))
    monkeypatch.setattr(liger_layer_norm.LigerLayerNormFunction, "apply",
                        staticmethod(lambda x, w, b, eps: seen.append((x, w, b, eps)) or x))
    gate, up = torch.randn(2, 8), torch.randn(2, 8)
    registry.get("liger", "geglu").build(GegluPatch(target="X", op="geglu"))(gate, up)
    assert seen[-1][0] is gate and seen[-1][1] is up
    x, w = torch.randn(3, 8), torch.randn(8)
    nemotron = LayerNormPatch(target="X", op="layer_norm", scale="one_plus_weight")
    registry.get("liger", "layer_norm").build(nemotron)(x, w, None, 1e-5)
    _, w_seen, b_seen, eps = seen[-1]
    assert torch.equal(w_seen, w + 1) and torch.equal(b_seen, torch.zeros(8)) and eps == 1e-5
