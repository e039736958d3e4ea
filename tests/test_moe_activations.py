"""MoE experts gated by another activation than SiLU: patched exactly, or refused naming the activation.

transformers' experts compute ``act_fn(gate) * up`` with ``act_fn = ACT2FN[config.hidden_act]``; its
own testers set ``hidden_act="gelu"``, and 30 MoE types were left unpatched under it with a reason about
gpt_oss's ``alpha`` (issue 47). Each activation of the ``mlp`` op is now a declaration of the experts,
checked bit for bit against the module's own; one that none computes is refused by its name.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import torch

import engine
from engine.errors import SignatureMismatch
from engine.kernels import registry
from engine.ops.base import get_op
from engine.schema import MoeExpertsPatch
from engine.tiny import build_tiny_model, perturb_

OP = get_op("moe_experts")
EXPERTS, TOP_K, HIDDEN, WIDTH, TOKENS = 6, 2, 32, 24, 11
#: hidden_act (transformers' ACT2FN name) -> the declaration that computes it
ACTS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_new", "quick_gelu": "quick_gelu",
        "relu": "relu", "relu2": "relu2", "silu": "silu"}
FAMILIES = [("qwen3_moe", "Qwen3MoeExperts"), ("mixtral", "MixtralExperts")]


def experts_of(model_type: str, cls_name: str, hidden_act: str) -> torch.nn.Module:
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type, hidden_size=HIDDEN, intermediate_size=WIDTH, moe_intermediate_size=WIDTH,
                                  num_experts=EXPERTS, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K,
                                  hidden_act=hidden_act)
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    torch.manual_seed(0)
    experts = getattr(module, cls_name)(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.5)
    return perturb_(experts)


def _run(experts: torch.nn.Module, forward, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    index = torch.randint(0, EXPERTS - 1, (TOKENS, TOP_K), generator=gen)  # the last expert gets no token
    index[0] = 2  # a token routed twice to one expert
    weights = torch.rand(TOKENS, TOP_K, generator=gen)
    experts.zero_grad(set_to_none=True)
    xs = x.clone().requires_grad_()
    out = forward(experts, xs, index, weights)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), [xs.grad, *(p.grad for p in experts.parameters())]


@pytest.mark.parametrize("hidden_act", list(ACTS))
@pytest.mark.parametrize(("model_type", "cls_name"), FAMILIES, ids=[f[0] for f in FAMILIES])
def test_the_activation_is_measured_and_the_torch_kernel_is_the_eager_loop_bit_for_bit(
    model_type: str, cls_name: str, hidden_act: str
) -> None:
    experts = experts_of(model_type, cls_name, hidden_act)
    fits = {p.activation.value for p in OP.candidates(experts)}
    assert fits == {ACTS[hidden_act]}  # only the activation the module computes is offered
    patch = MoeExpertsPatch(target=cls_name, op="moe_experts", activation=ACTS[hidden_act])
    OP.check_target(experts, patch)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(2)) * 2
    want_out, want = _run(experts, OP.ground_truth(experts), x)
    for kernel in ("torch", "grouped_mm"):
        got_out, got = _run(experts, OP.bind(experts, patch, registry.get(kernel, "moe_experts").build(patch)), x)
        if kernel == "torch":
            assert torch.equal(got_out, want_out) and all(map(torch.equal, got, want))
        else:  # one grouped matmul per projection: fp32 rounding of its own
            torch.testing.assert_close(got_out, want_out, rtol=1e-5, atol=1e-6 * float(want_out.abs().max()))
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6 * float(w.abs().max()))


def test_a_wrong_activation_is_refused_with_the_one_that_fits() -> None:
    experts = experts_of("qwen3_moe", "Qwen3MoeExperts", "gelu")
    with pytest.raises(SignatureMismatch, match=r"act_fn is GELUActivation \(hidden_act 'gelu'\), which does not "
                                                r"compute silu exactly; declare activation: gelu"):
        OP.check_target(experts, MoeExpertsPatch(target="Qwen3MoeExperts", op="moe_experts"))


def test_an_activation_no_declaration_computes_is_refused_by_its_name() -> None:
    """Mish: no declaration of the experts computes it; the refusal names it (not gpt_oss's alpha)."""
    experts = experts_of("mixtral", "MixtralExperts", "mish")
    candidates = list(OP.candidates(experts))
    assert [p.activation.value for p in candidates] and {p.activation.value for p in candidates} == {"silu"}
    with pytest.raises(SignatureMismatch) as refused:
        OP.check_target(experts, candidates[0])
    message = str(refused.value)
    assert "MishActivation (hidden_act 'mish')" in message and "these experts stay unpatched" in message
    assert "alpha" not in message


def test_zero_configuration_patches_gelu_experts_of_a_tiny_moe_model() -> None:
    """``engine.apply(model)`` on a tiny Qwen3-MoE whose config says ``hidden_act="gelu"`` (as transformers'
    tester does): the experts are patched (activation: gelu), and logits, loss and every gradient are the
    unpatched model's (its experts on transformers' default grouped_mm: within fp32 rounding)."""
    model = build_tiny_model("qwen3_moe", {"hidden_act": "gelu"})
    unpatched = copy.deepcopy(model)
    report = engine.apply(model)
    experts = [d for d in report.decisions if d.op == "moe_experts"]
    assert experts and all(d.action == "patch" for d in experts), report
    assert "activation: gelu" in str(report)
    ids = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(3))
    results = []
    for m in (model, unpatched):
        m.zero_grad(set_to_none=True)
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        results.append((out.logits.detach(), out.loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (logits, loss, grads), (want_logits, want_loss, want_grads) = results
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    assert grads.keys() == want_grads.keys()
    for name, want in want_grads.items():
        assert want is not None and grads[name] is not None, name
        torch.testing.assert_close(grads[name], want, rtol=1e-4, atol=1e-6 * float(want.abs().max()), msg=name)


def test_a_clamped_swiglu_under_other_attribute_names_is_measured() -> None:
    """MiniMax-M3's experts: gpt_oss's clamped swiglu on concatenated weights, read from ``swiglu_alpha`` and
    ``swiglu_limit`` (beside a ``limit`` of the same value, which would tie): the layout and storage its flags
    say, one declaration per layout tried, the eager loop's numbers."""
    from transformers import AutoConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLExperts

    config = AutoConfig.for_model("minimax_m3_vl").text_config
    for key, value in {"hidden_size": HIDDEN, "intermediate_size": WIDTH, "num_local_experts": EXPERTS}.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    experts = MiniMaxM3VLExperts(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0.0, 0.5)
    candidates = [p for p in OP.candidates(experts) if p.gate_up_proj == "gate_up_proj"]
    assert [(p.activation.value, p.alpha_attr, p.limit_attr, p.transposed) for p in candidates] == [
        ("clamped_swiglu", "swiglu_alpha", "swiglu_limit", False)]
    patch = candidates[0]
    OP.check_target(experts, patch)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(2)) * 3  # past the clamp limit
    want_out, want = _run(experts, OP.ground_truth(experts), x)
    got_out, got = _run(experts, OP.bind(experts, patch, OP.reference(patch)), x)
    assert torch.equal(got_out, want_out) and all(map(torch.equal, got, want))
