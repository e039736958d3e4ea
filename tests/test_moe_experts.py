"""The ``moe_experts`` op against each experts class's own eager forward, with gradients.

Every target class is built from its family's config (tiny sizes, perturbed weights) and
called on a routing that has duplicate routes (a token sent twice to one expert), an expert
that receives no token, and (where transformers allows it) the expert-parallel sentinel.
The ground truth is the class's eager forward (transformers' loop); fp32 results must be
exact (the torch kernel: bit-equal, grads included; grouped kernels: bit-equal forward,
grads within fp32 rounding), bf16 results are judged against the fp32 computation.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import os
import sys

import pytest
import torch
from conftest import tiny_for
from npu_emulator import make_torch_npu

import engine
from engine.errors import SignatureMismatch
from engine.kernels import registry
from engine.ops.base import get_op
from engine.schema import MoeExpertsPatch
from engine.tiny import perturb_

OP = get_op("moe_experts")
GPT_OSS = {"transposed": True, "layout": "interleaved", "activation": "clamped_swiglu",
           "gate_up_bias": "gate_up_proj_bias", "down_bias": "down_proj_bias"}
#: (model_type, experts class, declaration): the bundled MoE families and those whose experts share the shape.
TARGETS = [
    ("qwen2_moe", "Qwen2MoeExperts", {}),
    ("qwen3_moe", "Qwen3MoeExperts", {}),
    ("qwen3_next", "Qwen3NextExperts", {}),
    ("qwen3_5_moe_text", "Qwen3_5MoeExperts", {}),
    ("kimi_linear", "KimiLinearExperts", {}),
    ("mixtral", "MixtralExperts", {}),
    ("deepseek_v3", "DeepseekV3Experts", {}),
    ("olmoe", "OlmoeExperts", {}),
    ("glm4_moe", "Glm4MoeExperts", {}),
    ("ernie4_5_moe", "Ernie4_5_MoeExperts", {}),
    ("gpt_oss", "GptOssExperts", GPT_OSS),
]
EXPERTS, TOP_K, HIDDEN, WIDTH, TOKENS = 6, 3, 32, 24, 13


def build_experts(model_type: str, cls_name: str) -> torch.nn.Module:
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, hidden_size=HIDDEN, intermediate_size=WIDTH, moe_intermediate_size=WIDTH,
                                  num_experts=EXPERTS, num_local_experts=EXPERTS, n_routed_experts=EXPERTS,
                                  num_experts_per_tok=TOP_K, swiglu_limit=0.3)
    package = model_type.removesuffix("_text")
    module = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    torch.manual_seed(0)
    experts = getattr(module, cls_name)(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.3)
    return perturb_(experts)


def routing(sentinel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routes with duplicates (tokens 0 and 1), expert 4 never chosen, optionally the sentinel."""
    gen = torch.Generator().manual_seed(1)
    index = torch.tensor([0, 1, 2, 3, 5])[torch.randint(0, 5, (TOKENS, TOP_K), generator=gen)]
    index[0] = torch.tensor([2, 2, 2])
    index[1] = torch.tensor([5, 0, 5])
    if sentinel:
        index[2, 1] = EXPERTS
    weights = torch.rand(TOKENS, TOP_K, generator=gen)
    return index, weights


def run(experts: torch.nn.Module, forward, dtype: torch.dtype, index: torch.Tensor, weights: torch.Tensor,
        x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Output and gradients (input, routing weights, every parameter) for one fixed upstream gradient."""
    experts.zero_grad(set_to_none=True)
    xs = x.detach().to(dtype).clone().requires_grad_()
    ws = weights.detach().to(dtype).clone().requires_grad_()
    out = forward(experts, xs, index, ws)
    upstream = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
    (out.float() * upstream).sum().backward()
    grads = {"hidden_states": xs.grad, "top_k_weights": ws.grad}
    grads.update({n: p.grad for n, p in experts.named_parameters()})
    return out.detach(), grads


def patched(experts: torch.nn.Module, decl: dict, kernel: str):
    patch = MoeExpertsPatch(target=type(experts).__name__, op="moe_experts", **decl)
    OP.check_target(experts, patch)
    return OP.bind(experts, patch, registry.get(kernel, "moe_experts").build(patch))


def truth(experts: torch.nn.Module):
    return OP.ground_truth(experts)


def _input(scale: float = 1.0) -> torch.Tensor:
    return torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(2)) * scale


@pytest.mark.parametrize("kernel", ["torch", "grouped_mm"])
@pytest.mark.parametrize(("model_type", "cls_name", "decl"), TARGETS, ids=[t[0] for t in TARGETS])
def test_fp32_exact_with_duplicates_and_empty_experts(model_type, cls_name, decl, kernel) -> None:
    experts = build_experts(model_type, cls_name)
    sentinel = model_type != "gpt_oss"  # gpt_oss's eager loop one-hots over E classes: no sentinel
    index, weights = routing(sentinel)
    x = _input(3.0 if model_type == "gpt_oss" else 1.0)  # gpt_oss: past the clamp limit
    want_out, want = run(experts, truth(experts), torch.float32, index, weights, x)
    got_out, got = run(experts, patched(experts, decl, kernel), torch.float32, index, weights, x)
    if kernel == "torch":
        assert torch.equal(got_out, want_out)
    else:  # same sums in the same order; the grouped matmul itself may round a row 1 ulp apart
        torch.testing.assert_close(got_out, want_out, rtol=1e-6, atol=1e-6 * float(want_out.abs().max()))
    for name, g in want.items():
        assert torch.isfinite(got[name]).all(), name
        if kernel == "torch":
            assert torch.equal(got[name], g), name
        else:
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6 * float(g.abs().max()), msg=name)
    for name, p in experts.named_parameters():  # expert 4 received no token: exactly zero gradient
        assert torch.count_nonzero(got[name][4]) == 0 and torch.count_nonzero(want[name][4]) == 0, name
    if sentinel:  # the sentinel route contributes nothing and gets no gradient
        assert got["top_k_weights"][2, 1] == 0


def judge_bf16(experts: torch.nn.Module, decl: dict, kernel: str, index: torch.Tensor, weights: torch.Tensor,
               x: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """bf16 ``kernel`` on a bf16 copy of ``experts``: output and every gradient finite and at most
    2x as far from the fp32 loop as the bf16 loop is. Returns (kernel's, loop's) results by name."""
    exact_out, exact = run(experts, truth(experts), torch.float32, index, weights, x)
    low = copy.deepcopy(experts).to(torch.bfloat16)
    want_out, want = run(low, truth(low), torch.bfloat16, index, weights, x)
    got_out, got = run(low, patched(low, decl, kernel), torch.bfloat16, index, weights, x)
    exact["output"], want["output"], got["output"] = exact_out, want_out, got_out
    for name, fp32 in exact.items():
        assert torch.isfinite(got[name]).all(), name
        err_got = float((got[name].double() - fp32.double()).abs().max())
        err_want = float((want[name].double() - fp32.double()).abs().max())
        assert err_got <= 2 * err_want + 1e-3 * float(fp32.abs().max()), (name, err_got, err_want)
    return got, want


@pytest.mark.parametrize("kernel", ["torch", "grouped_mm"])
@pytest.mark.parametrize(("model_type", "cls_name", "decl"), [TARGETS[1], TARGETS[-1]], ids=["qwen3_moe", "gpt_oss"])
def test_bf16_judged_against_fp32(model_type, cls_name, decl, kernel) -> None:
    """bf16: output and every gradient at most 2x as far from fp32 as the eager loop's (torch: bit-equal)."""
    got, want = judge_bf16(build_experts(model_type, cls_name), decl, kernel, *routing(), _input())
    if kernel == "torch":
        assert torch.equal(got["output"], want["output"])


def test_npu_provider_on_the_documented_contract(monkeypatch) -> None:
    """npu: permute -> grouped matmul x2 -> unpermute (weights applied there), on the emulator."""
    emulator = make_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", emulator)
    for model_type, cls_name, decl in (TARGETS[1], TARGETS[-1]):
        experts = build_experts(model_type, cls_name)
        index, weights = routing()
        x = _input()
        want_out, want = run(experts, truth(experts), torch.float32, index, weights, x)
        emulator.calls.clear()
        got_out, got = run(experts, patched(experts, decl, "npu"), torch.float32, index, weights, x)
        assert emulator.calls == ["npu_moe_token_permute", "npu_grouped_matmul", "npu_grouped_matmul",
                                  "npu_moe_token_unpermute"]
        torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6)
        for name, g in want.items():
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-6 * float(g.abs().max()), msg=name)


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PATCH_ENGINE_SLOW_INTERPRET"),
                    reason="interpreted, a minute on 2 cores: run by .ci/interpret (PATCH_ENGINE_SLOW_INTERPRET=1)")
def test_liger_interpreted(monkeypatch) -> None:
    """liger's fused MoE (Triton, run by Triton's CPU interpreter): output and every gradient vs the eager loop,
    duplicate routes and an expert nobody chose included."""
    pytest.importorskip("liger_kernel")
    import triton

    from engine.kernels.triton_interpret import interpreting

    experts = build_experts("qwen3_moe", "Qwen3MoeExperts")
    index, weights = routing()
    x = _input()
    want_out, want = run(experts, truth(experts), torch.float32, index, weights, x)
    with interpreting():
        tf32_out, _ = run(experts, patched(experts, {}, "liger"), torch.float32, index, weights, x)
        # fp32 dots in full precision (a GPU does this with TRITON_F32_DEFAULT=ieee): the mapping, exactly
        monkeypatch.setattr(triton.knobs.language, "fp32_default", "ieee")
        got_out, got = run(experts, patched(experts, {}, "liger"), torch.float32, index, weights, x)
    # by default Triton's fp32 tl.dot is TF32 on NVIDIA (10 mantissa bits): off by TF32 rounding, not more
    tf32_err = float((tf32_out - want_out).abs().max() / want_out.abs().max())
    assert 1e-6 < tf32_err < 5e-3, tf32_err
    torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-5)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()), msg=name)
    provider = registry.get("liger", "moe_experts")
    assert "concatenated" in provider.supports(MoeExpertsPatch(target="X", op="moe_experts", **GPT_OSS))
    # bf16, where `auto` picks liger: the backward's tl.atomic_add into bf16 runs (the bf16_atomic shim); output and
    # every gradient no further from the fp32 loop than transformers' own bf16 loop is (2x, as the verifier's budget)
    low = copy.deepcopy(experts).to(torch.bfloat16)
    eager_out, eager = run(low, truth(low), torch.bfloat16, index, weights, x)
    with interpreting():
        bf16_out, bf16 = run(low, patched(low, {}, "liger"), torch.bfloat16, index, weights, x)
    assert bf16_out.dtype == torch.bfloat16
    for name, got_g, eager_g, want_g in [("output", bf16_out, eager_out, want_out),
                                         *((n, bf16[n], eager[n], want[n]) for n in want)]:
        scale = float(want_g.abs().max())
        err, eager_err = (float((g.float() - want_g).abs().max()) / scale for g in (got_g, eager_g))
        assert err <= 2 * eager_err + 1e-6, (name, err, eager_err)


def test_keyword_call_and_signature_names() -> None:
    model = tiny_for("gpt_oss")
    original = inspect.signature(model.model.layers[0].mlp.experts.forward)
    engine.apply(model, "gpt_oss", device="cpu")
    assert inspect.signature(model.model.layers[0].mlp.experts.forward) == original
    experts = build_experts("gpt_oss", "GptOssExperts")
    index, weights = routing()
    x = _input()
    forward = patched(experts, GPT_OSS, "grouped_mm")
    want = forward(experts, x, index, weights)
    assert torch.equal(forward(experts, x, router_indices=index, routing_weights=weights), want)
    assert torch.equal(forward(experts, hidden_states=x, router_indices=index, routing_weights=weights), want)


@pytest.mark.parametrize(("decl", "message"), [
    ({**GPT_OSS, "layout": "concatenated"}, "is_concatenated is False"),
    ({**GPT_OSS, "transposed": False}, "is_transposed is True"),
    ({k: v for k, v in GPT_OSS.items() if "bias" not in k}, "has_bias is True"),
    ({**GPT_OSS, "activation": "silu"}, "does not compute silu"),
    ({**GPT_OSS, "down_proj": "down"}, "no 3-D tensor 'down'"),
])
def test_plan_refuses_a_wrong_declaration(decl, message) -> None:
    model = tiny_for("gpt_oss")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = {"name": "mine", "model_types": ["gpt_oss"],
            "patches": [{"target": "GptOssExperts", "op": "moe_experts", **decl}]}
    with pytest.raises(SignatureMismatch, match=message):
        engine.apply(model, data, device="cpu")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert "forward" not in model.model.layers[0].mlp.experts.__dict__


def test_plan_refuses_ungated_experts() -> None:
    from transformers import AutoConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    config = AutoConfig.for_model("nemotron_h", hidden_size=HIDDEN, moe_intermediate_size=WIDTH, n_routed_experts=4,
                                  num_experts_per_tok=2)
    experts = NemotronHExperts(config)
    with pytest.raises(SignatureMismatch, match="has_gate=False"):
        OP.check_target(experts, MoeExpertsPatch(target="NemotronHExperts", op="moe_experts"))


def test_verify_checks_against_the_eager_loop_under_the_default_implementation() -> None:
    """A model on transformers' default (grouped_mm) verifies: declaration vs the eager forward, bit-exact."""
    model = tiny_for("qwen3_moe")
    assert model.config._experts_implementation == "grouped_mm"
    report = engine.apply(model, "qwen3_moe", device="cpu")
    assert {d.kernel for d in report.decisions if d.op == "moe_experts"} == {"grouped_mm"}
    checks = [c for c in engine.verify(model).checks if c.op == "moe_experts"]
    assert checks and all(c.passed for c in checks)
    assert all(c.max_abs == 0 for c in checks if c.what == "declaration")


def test_compiled_provider_bf16_judged_against_fp32_and_fp32_uncompiled(monkeypatch) -> None:
    """compiled: bf16 through inductor (as close to fp32 as the eager loop, empty expert exactly zero);
    fp32 is the uncompiled grouped path, bit for bit (grouped_mm's meta function is bf16-only)."""
    from engine.kernels import compiled

    if compiled.find_cxx() is None:
        pytest.skip("no C++ compiler for inductor")
    monkeypatch.setenv(compiled.ENV_SWITCH, "1")
    experts = build_experts("qwen3_moe", "Qwen3MoeExperts")
    index, weights = routing()
    x = _input()
    fp32_got = run(experts, patched(experts, {}, "compiled"), torch.float32, index, weights, x)
    fp32_want = run(experts, patched(experts, {}, "grouped_mm"), torch.float32, index, weights, x)
    assert torch.equal(fp32_got[0], fp32_want[0])
    assert all(torch.equal(fp32_got[1][n], g) for n, g in fp32_want[1].items())
    got, _ = judge_bf16(experts, {}, "compiled", index, weights, x)
    for name, _ in experts.named_parameters():  # expert 4 received no token
        assert torch.count_nonzero(got[name][4]) == 0, name
    kernels = [k for key, k in compiled._CACHE.items() if key[0] == "moe_experts"]
    assert kernels and not any(k.failed for k in kernels)  # it compiled: no fallback to the reference


def test_compiled_experts_in_a_bf16_training_step_of_a_moe_model(monkeypatch) -> None:
    """What ``auto`` gives a user training a MoE model in bf16 on a CPU: the compiled experts, forward and
    backward through inductor, two optimizer steps; losses and gradients near the unpatched model's (bf16
    rounding apart), and no fallback. On torch 2.14.1 the backward graph's compile crashed the step (inductor
    could not bind the unbacked size of ``bincount``'s result: ``For Min(s99, u0), expected [u0] to have been
    codegen-ed``); the routes are now counted into a tensor of static size."""
    import warnings

    from engine.kernels import compiled
    from engine.tiny import build_tiny_model

    if compiled.find_cxx() is None:
        pytest.skip("no C++ compiler for inductor")
    monkeypatch.setenv(compiled.ENV_SWITCH, "1")
    config = {"num_experts": EXPERTS, "num_experts_per_tok": 2, "moe_intermediate_size": WIDTH}
    model = build_tiny_model("qwen3_moe", config, dtype=torch.bfloat16)
    unpatched = copy.deepcopy(model)
    report = engine.apply(model, "qwen3_moe", mode="training")
    experts = [d for d in report.decisions if d.action == "patch" and d.op == "moe_experts"]
    assert experts and all(d.kernel == "compiled" for d in experts), [(d.op, d.kernel) for d in experts]
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(3))
    losses: dict[str, list[float]] = {"patched": [], "unpatched": []}
    grads: dict[str, dict[str, torch.Tensor]] = {}  # the first step's, by run and parameter
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a compiled kernel falling back warns: not here
        for run_name, m in (("patched", model), ("unpatched", unpatched)):
            m.train()
            optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
            for _ in range(2):
                optimizer.zero_grad(set_to_none=True)
                loss = m(input_ids=ids, labels=ids).loss
                loss.backward()
                grads.setdefault(run_name, {n: p.grad.float().clone() for n, p in m.named_parameters()})
                losses[run_name].append(float(loss.detach()))
                optimizer.step()
    kernels = [k for key, k in compiled.kernels().items() if key[0] == "moe_experts"]
    assert kernels and any(k.functions for k in kernels) and not any(k.failed for k in kernels)
    for got, want in zip(losses["patched"], losses["unpatched"], strict=True):
        assert abs(got - want) <= 0.02 * abs(want), losses
    for n, want in grads["unpatched"].items():
        got = grads["patched"][n]
        assert torch.isfinite(got).all(), n
        cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
        assert want.abs().max() == 0 or cos > 0.98, (n, float(cos))
