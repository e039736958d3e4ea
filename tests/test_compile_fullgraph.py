"""A patched model compiles wherever the unpatched one does, ``fullgraph=True`` included.

The compiled runs go through transformers' own compiled ``generate``: a static cache with a
``CompileConfig(fullgraph=True, dynamic=False)`` (what ``test_generate_compile_model_forward_fullgraph``
in transformers' suite runs for every model declaring ``_can_compile_fullgraph``), forced on
the CPU. Backend ``eager``: dynamo alone, which is where routing (engine/runtime/routing.py) and the
MoE kernels' tracing (``grouped_mm``'s bf16-only meta function) could fail; AOTAutograd and
inductor add minutes on two cores and test torch, not the engine. The outputs are compared
with the unpatched model generating eagerly.

Also here: experts_implementation honoured, and a model whose kernels cannot be traced stops
advertising ``_can_compile_fullgraph``.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from conftest import tiny_for
from training_helpers import extra_kernel, patched, qwen3_patchset

import engine
from engine.ops.rope import rope_reference

BACKEND = "eager"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _generate(model: torch.nn.Module, ids: torch.Tensor, *, compiled: bool) -> torch.Tensor:
    """Greedy tokens; compiled: transformers' static-cache auto-compile of the forward, fullgraph."""
    from transformers import CompileConfig

    kwargs: dict = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0, "attention_mask": torch.ones_like(ids)}
    if not compiled:
        with torch.compiler.set_stance("force_eager"):
            return model.generate(ids, **kwargs)
    config = CompileConfig(fullgraph=True, dynamic=False, backend=BACKEND)
    config._compile_all_devices = True  # force compilation on the CPU, as transformers' test does
    out = model.generate(ids, cache_implementation="static", compile_config=config, **kwargs)
    assert hasattr(model, "_compiled_call"), "generate did not take its compiled path"
    return out


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(1, 200, (2, 6), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("family", "layers"), [("llama", 1), ("gemma3_text", 2), ("qwen3_moe", 2)])
def test_compiled_generate_fullgraph_matches_unpatched(family: str, layers: int) -> None:
    """Function patches (rope) and module patches, MoE experts (fp32) included, under a fullgraph compile."""
    base = tiny_for(family, num_hidden_layers=layers).eval()
    model = copy.deepcopy(base)
    ids = _ids()
    expected = _generate(base, ids, compiled=False)
    report = engine.apply(model, family, device="cpu", mode="inference")
    assert any(d.cls == "function" for d in report.decisions if d.action == "patch")  # a routed function patch
    assert report.fullgraph_blocker is None and model._can_compile_fullgraph
    first = _generate(model, ids, compiled=True)
    torch.testing.assert_close(first, expected, rtol=0, atol=0)
    # A second generation with other tokens of the same shape reuses the graph: no recompile.
    with torch.compiler.set_stance("fail_on_recompile"):
        second = _generate(model, _ids(1), compiled=True)
    engine.revert(model)
    torch.testing.assert_close(second, _generate(base, _ids(1), compiled=False), rtol=0, atol=0)


def skewed_rope(q, k, cos, sin, unsqueeze_dim=1):
    """Deliberately not rope: the tokens show whether the compiled graph called the patch's kernel."""
    q, k = rope_reference(q, k, cos, sin, unsqueeze_dim)
    return q * 1.5, k


def test_fullgraph_route_reaches_the_patched_models_kernel_only() -> None:
    """The routed function is the patch's kernel inside the patched model's graph, the original in another's."""
    base = tiny_for("qwen3", num_hidden_layers=1).eval()
    model, other = copy.deepcopy(base), copy.deepcopy(base)
    ids = _ids()
    with extra_kernel("skewed", "rope", skewed_rope), \
            patched(model, patchset=qwen3_patchset(rope="skewed"), unverified="trust"):
        model.eval()
        eager_logits = model(input_ids=ids).logits
        compiled = torch.compile(model, fullgraph=True, backend=BACKEND)
        torch.testing.assert_close(compiled(input_ids=ids).logits, eager_logits)
        # the other model of the family, compiled while the router is installed, reaches the original
        other_compiled = torch.compile(other, fullgraph=True, backend=BACKEND)
        torch.testing.assert_close(other_compiled(input_ids=ids).logits, base(input_ids=ids).logits)
    assert (eager_logits - base(input_ids=ids).logits).abs().max() > 1e-2  # the skewed kernel shows


def test_moe_experts_train_under_compile_in_fp32() -> None:
    """grouped_mm's meta function takes bf16 only: fp32 compiles through the opaque op, backward included."""
    base = tiny_for("qwen3_moe", num_hidden_layers=2)
    eager, model = copy.deepcopy(base), copy.deepcopy(base)
    ids = _ids()
    for m in (eager, model):
        report = engine.apply(m, "qwen3_moe", device="cpu", mode="training")
        assert {d.kernel for d in report.decisions if d.op == "moe_experts"} == {"grouped_mm"}
    out_e = eager(input_ids=ids, labels=ids)
    out_e.loss.backward()
    out_c = torch.compile(model, fullgraph=True, backend="aot_eager")(input_ids=ids, labels=ids)
    out_c.loss.backward()
    torch.testing.assert_close(out_c.logits, out_e.logits, rtol=0, atol=0)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    expected = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
    assert grads.keys() == expected.keys() and any("experts" in n for n in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=0, atol=0, msg=name)
    engine.revert(eager)
    engine.revert(model)


def test_moe_experts_trace_in_bf16() -> None:
    """bf16 takes torch's grouped_mm itself under compile (its meta function accepts bf16)."""
    base = tiny_for("qwen3_moe", num_hidden_layers=2, dtype=torch.bfloat16).eval()
    model = copy.deepcopy(base)
    engine.apply(model, "qwen3_moe", device="cpu", mode="inference")
    ids = _ids()
    compiled = torch.compile(model, fullgraph=True, backend=BACKEND)
    torch.testing.assert_close(compiled(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)
    engine.revert(model)


def test_opaque_grouped_mm_double_backward_matches_torchs_own() -> None:
    from engine.kernels.moe import _eager_grouped_mm

    gen = torch.Generator().manual_seed(0)
    counts = torch.tensor([3, 0, 6, 2])
    x = torch.randn(11, 16, generator=gen, requires_grad=True)
    w = torch.randn(4, 16, 8, generator=gen, requires_grad=True)

    def penalty(fn):
        y = fn(x, w, counts)
        gx, gw = torch.autograd.grad((y * y).sum(), (x, w), create_graph=True)
        return torch.autograd.grad(gx.square().sum() + gw.square().sum(), (x, w))

    for ours, theirs in zip(penalty(torch.ops.patch_engine.grouped_mm), penalty(_eager_grouped_mm), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=2e-5, atol=1e-5)  # other second-order formulas: rounding


# ---- experts_implementation: the user's choice is honoured


def test_explicit_experts_implementation_is_honoured_at_plan_time() -> None:
    model = tiny_for("qwen3_moe")
    model.set_experts_implementation("batched_mm")
    report = engine.apply(model, "qwen3_moe", device="cpu")
    experts = [d for d in report.decisions if d.op == "moe_experts"]
    assert experts and all(d.action == "skip" and "'batched_mm', chosen by the user" in d.reason for d in experts)
    assert all("forward" not in model.get_submodule(d.path).__dict__ for d in experts)
    assert any(d.action == "patch" for d in report.decisions)  # the rest of the patchset applies
    engine.revert(model)


def test_switching_experts_implementation_after_apply_is_honoured() -> None:
    """transformers' dispatcher runs the implementation switched to, grouped_mm too once the user has chosen
    (transformers' own test_eager_matches_batched_and_grouped_inference switches eager -> batched_mm ->
    grouped_mm and expects each to run); apply again after a revert, and the patch's kernel stands in again."""
    from transformers.integrations import moe

    model = tiny_for("qwen3_moe")
    ids = _ids()
    expected = model(input_ids=ids).logits
    report = engine.apply(model, "qwen3_moe", device="cpu")
    assert any(d.op == "moe_experts" and d.action == "patch" for d in report.decisions)
    batched = mock.Mock(wraps=moe.batched_mm_experts_forward)
    grouped = mock.Mock(wraps=moe.grouped_mm_experts_forward)
    with mock.patch.dict(moe.ALL_EXPERTS_FUNCTIONS._global_mapping, {"batched_mm": batched, "grouped_mm": grouped}):
        model.set_experts_implementation("batched_mm")
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)
        assert batched.called and not grouped.called
        batched.reset_mock()
        model.set_experts_implementation("grouped_mm")  # the default, but now the user's choice: transformers' runs
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)
        assert grouped.called and not batched.called
        grouped.reset_mock()
        engine.revert(model)
        engine.apply(model, "qwen3_moe", device="cpu")  # nothing chosen since: the kernel stands in for grouped_mm
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)
        assert not batched.called and not grouped.called
    engine.revert(model)


# ---- a kernel dynamo cannot trace: eager between graphs, and no fullgraph claim


def _counting_rope(calls: list[int]):
    def rope(q, k, cos, sin, unsqueeze_dim=1):
        calls.append(1)
        return skewed_rope(q, k, cos, sin, unsqueeze_dim)

    return rope


def test_compile_unsafe_function_kernel_runs_in_its_eager_caller_and_blocks_fullgraph() -> None:
    """Not compile-safe: the caller runs eagerly around the kernel (still the patch's), and the model says why."""
    base = tiny_for("qwen3", num_hidden_layers=2).eval()
    model = copy.deepcopy(base)
    calls: list[int] = []
    ids = _ids()
    assert type(model)._can_compile_fullgraph
    with extra_kernel("eager_rope", "rope", _counting_rope(calls), compile_safe=False), \
            patched(model, patchset=qwen3_patchset(rope="eager_rope"), unverified="trust") as (report,):
        model.eval()
        assert model._can_compile_fullgraph is False
        assert "eager_rope" in report.fullgraph_blocker and "_can_compile_fullgraph" in str(report)
        expected = model(input_ids=ids).logits
        calls.clear()
        out = torch.compile(model, backend=BACKEND)(input_ids=ids).logits
        assert len(calls) == 2  # one per layer: the compiled model called the patch's kernel
        torch.testing.assert_close(out, expected)
        pickled = copy.deepcopy(model)
        assert pickled._can_compile_fullgraph is False
        engine.revert(pickled)
        assert "_can_compile_fullgraph" not in pickled.__dict__
    assert "_can_compile_fullgraph" not in model.__dict__ and model._can_compile_fullgraph
