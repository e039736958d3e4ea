"""``kernel: auto`` on CUDA passes over vendor kernels measured to fail the verifier at the model's dtype.

The measurements (engine/_data/vendor_dtypes.yaml) come from the interpreted verify
(``verify --device cuda --interpret``): liger's fused MoE computes its fp32 dots in TF32, fla's chunk
kernels in TF32 (fp32) and with bf16 intermediates (bf16). Plans only: no kernel runs here.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import tiny_for

import engine
from engine.kernels.vendor_dtypes import unverified
from engine.loader import load_patchset
from engine.planning.kernel_choice import resolve_kernel
from engine.schema import Device, OnUnsupported
from engine.verification.modules import _unverified_elsewhere

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("liger_kernel") is None or importlib.util.find_spec("fla") is None,
    reason="liger-kernel and fla (extra: cuda) decide what auto picks on CUDA",
)


def _experts(plan: engine.Plan) -> list:
    return [d for d in plan.decisions if d.op == "moe_experts" and d.action == "patch"]


@pytest.fixture(scope="module")
def moe_models() -> dict[torch.dtype, torch.nn.Module]:
    return {dt: tiny_for("qwen3_moe", dtype=dt) for dt in (torch.float32, torch.bfloat16)}


def test_fp32_moe_passes_liger_over_bf16_takes_it(moe_models) -> None:
    fp32 = _experts(engine.plan(moe_models[torch.float32], "qwen3_moe", device="cuda", mode="training"))
    bf16 = _experts(engine.plan(moe_models[torch.bfloat16], "qwen3_moe", device="cuda", mode="training"))
    assert fp32 and bf16
    assert {d.kernel for d in fp32} == {"grouped_mm"}
    assert "passed over liger: liger fused MoE" in fp32[0].reason and "TF32" in fp32[0].reason
    assert {d.kernel for d in bf16} == {"liger"}
    # the bf16 model's kernel is checked in fp32 too: a failure there is shown, not counted
    assert _unverified_elsewhere(bf16[0], torch.float32) is not None
    assert _unverified_elsewhere(bf16[0], torch.bfloat16) is None


def test_explicit_liger_in_fp32_is_kept_with_a_warning(moe_models) -> None:
    ps = load_patchset("qwen3_moe").model_dump(mode="json", exclude_none=True)
    for p in ps["patches"]:
        if p.get("op") == "moe_experts":
            p["kernel"] = "liger"
    got = _experts(engine.plan(moe_models[torch.float32], ps, device="cuda", mode="training"))
    assert {d.kernel for d in got} == {"liger"}
    assert "warning" in got[0].reason and "verify measures the difference" in got[0].reason


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fla_chunk_passed_over_in_both_dtypes_declared_kept(dtype) -> None:
    patch = next(p for p in load_patchset("qwen3_5_text").patches if p.op == "linear_attention")
    auto, why = resolve_kernel("linear_attention", "auto", Device.cuda, "training", OnUnsupported.error,
                               patch=patch, dtype=dtype)
    assert auto.name == "torch" and "passed over fla: fla chunk kernels" in why
    fla, why = resolve_kernel("linear_attention", "fla", Device.cuda, "training", OnUnsupported.error,
                              patch=patch, dtype=dtype)
    assert fla.name == "fla" and "warning" in why


def test_rule_is_for_cuda_and_known_dtypes_only() -> None:
    assert unverified("liger", "moe_experts", "cuda", torch.float32) is not None
    assert unverified("liger", "moe_experts", "cuda", torch.bfloat16) is None
    assert unverified("liger", "moe_experts", "npu", torch.float32) is None  # measured on NVIDIA's TF32 only
    assert unverified("liger", "moe_experts", "cuda", None) is None
    assert unverified("liger", "rms_norm", "cuda", torch.float32) is None


def test_fp32_moe_cuda_plan_passes_verify_interpreted(moe_models) -> None:
    """The default CUDA plan of an fp32 MoE model, its liger kernels run by Triton's interpreter, passes
    verify (with liger's fused MoE it failed: 2.2e+03x the original's own error)."""
    from engine.kernels.triton_interpret import interpreting
    from engine.verification import probe_batch, verify

    model = moe_models[torch.float32]
    with interpreting():
        report = engine.apply(model, "qwen3_moe", device="cuda")
        try:
            assert {d.kernel for d in report.decisions if d.op == "rms_norm" and d.action == "patch"} == {"liger"}
            verdict = verify(model, batch=probe_batch(model, batch=1, seq=8), modules="sample",
                             raise_on_failure=False)
        finally:
            engine.revert(model)
    assert verdict.passed, verdict.table()
    assert any(c.op == "moe_experts" and c.kernel == "grouped_mm" for c in verdict.checks)


def test_bf16_model_liger_moe_fp32_check_shown_not_counted(moe_models) -> None:
    """A bf16 model keeps liger's fused MoE; verify's fp32 check of it (TF32 dots, interpreted) fails
    as measured and is shown with the reason, not counted; its bf16 check passes on its own merits."""
    from engine.kernels.triton_interpret import interpreting
    from engine.verification.modules import verify_module

    model = moe_models[torch.bfloat16]
    with interpreting():
        report = engine.apply(model, "qwen3_moe", device="cuda")
        try:
            d = next(x for x in report.decisions if x.op == "moe_experts" and x.action == "patch")
            module = model.get_submodule(d.path)
            experts, hidden = module.down_proj.shape[0], module.down_proj.shape[1]
            g = torch.Generator().manual_seed(0)
            x = torch.randn(8, hidden, generator=g)
            index = torch.stack([torch.randperm(experts, generator=g)[:2] for _ in range(8)])
            weights = torch.softmax(torch.randn(8, 2, generator=g), -1)
            checks = verify_module(d, module, (x, index, weights), {}, torch.bfloat16)
        finally:
            engine.revert(model)
    kernel = {c.dtype: c for c in checks if c.what == "kernel"}
    assert d.kernel == "liger" and set(kernel) == {"fp32", "bf16"}
    assert kernel["fp32"].passed and kernel["fp32"].note.startswith("not counted (the model is bf16)")
    assert kernel["fp32"].max_abs > 1e-4  # the TF32 difference is really there (fp32 rounding is ~1e-7)
    assert kernel["bf16"].passed and not kernel["bf16"].note.startswith("not counted")
