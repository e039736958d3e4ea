"""CUDA checks of the moe_experts providers (grouped_mm, liger) against the eager experts loop.

Routing with duplicate routes and an expert that receives no token (the cases behind known
NaN-gradient bugs of fused MoE kernels): outputs and every gradient finite, the empty
expert's gradient exactly zero, fp32 within 1e-4 of the loop (TF32 is off), bf16 at most 2x
as far from the fp32 loop as the bf16 loop is.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from test_moe_experts import TARGETS, build_experts, judge_bf16, patched, routing, run, truth

pytestmark = pytest.mark.cuda
needs_liger = pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel missing")


@pytest.mark.parametrize("kernel", ["grouped_mm", pytest.param("liger", marks=needs_liger)])
@pytest.mark.parametrize(("model_type", "cls_name", "decl"), [TARGETS[1], TARGETS[-1]], ids=["qwen3_moe", "gpt_oss"])
def test_cuda_moe_experts(kernel, model_type, cls_name, decl) -> None:
    if kernel == "liger" and decl:
        pytest.skip("liger's fused MoE takes concatenated, untransposed, unbiased silu experts only")
    torch.backends.cuda.matmul.allow_tf32 = False
    experts = build_experts(model_type, cls_name).cuda()
    index, weights = routing()
    index, weights = index.cuda(), weights.cuda()
    x = torch.randn(index.shape[0], experts.gate_up_proj.shape[2 if not decl else 1], device="cuda")
    exact_out, exact = run(experts, truth(experts), torch.float32, index, weights, x)
    got_out, got = run(experts, patched(experts, decl, kernel), torch.float32, index, weights, x)
    torch.testing.assert_close(got_out, exact_out, rtol=1e-4, atol=1e-4)
    for name, g in exact.items():
        assert torch.isfinite(got[name]).all(), name
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-4 * float(g.abs().max()), msg=name)
    for name, _ in experts.named_parameters():
        assert torch.count_nonzero(got[name][4]) == 0, name
    judge_bf16(experts, decl, kernel, index, weights, x)
