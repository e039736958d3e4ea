"""torch.compile of a patched model: forward and backward match eager, on CPU.

The compile tests use the ``aot_eager`` backend: it runs dynamo (where routing through a
ContextVar and wrapped forwards could fail) and AOTAutograd (the traced forward and backward
graphs), without inductor's C++ code generation, which takes ~50 s for this model on two
cores and would test inductor, not the engine.

Function patches (rope) are routed through a list dynamo traces (engine/runtime/routing.py), and
module patches are plain forwards: a patched model has the unpatched model's graph breaks,
no more (tests/test_compile_fullgraph.py compiles with ``fullgraph=True``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_for
from training_helpers import extra_kernel, grads, max_diff, patched, qwen3_patchset

from engine.ops.rms_norm import rms_norm_reference
from engine.ops.rope import rope_reference

TOL = 1e-5
BACKEND = "aot_eager"


def skewed_rope(q, k, cos, sin, unsqueeze_dim=1):
    """Deliberately not rope: lets the numbers show which function the compiled model called."""
    q, k = rope_reference(q, k, cos, sin, unsqueeze_dim)
    return q * 1.5, k


@torch.library.custom_op("patch_engine_test::opaque_rms_norm", mutates_args=())
def opaque_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Emulates a vendor kernel dynamo cannot trace: an extension op with no fake (meta) impl.

    torch.compile fails on it with "no fake impl registered", as on many real extension ops.
    Its backward is the reference's, so it trains.
    """
    return rms_norm_reference(x, weight, eps)


def _setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _backward(ctx, grad):
    x, weight = ctx.saved_tensors
    _, vjp = torch.func.vjp(lambda a, b: rms_norm_reference(a, b, ctx.eps), x, weight)
    gx, gw = vjp(grad)
    return gx, gw, None


opaque_rms_norm.register_autograd(_backward, setup_context=_setup)


def _step(model, ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach()


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_patched_model_matches_eager_forward_and_backward() -> None:
    base = tiny_for("qwen3", num_hidden_layers=1)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    eager, compiled_model = copy.deepcopy(base), copy.deepcopy(base)
    with extra_kernel("skewed", "rope", skewed_rope), \
            patched(eager, compiled_model, patchset=qwen3_patchset(rope="skewed"), unverified="trust"):
        logits_e, loss_e = _step(eager, ids)
        logits_c, loss_c = _step(torch.compile(compiled_model, backend=BACKEND), ids)
    unpatched_logits, _ = _step(copy.deepcopy(base), ids)
    assert (logits_e - unpatched_logits).abs().max() > 1e-2  # the skewed kernel shows in the numbers...
    assert (logits_c - logits_e).abs().max() <= TOL  # ...and the compiled model ran it, like eager
    assert abs(loss_c - loss_e) <= TOL
    assert max_diff(grads(compiled_model), grads(eager)) <= TOL


def test_patches_add_no_graph_break() -> None:
    """Norm, MLP and rope (a routed function) patches: the same graph breaks as unpatched (none here).

    Also while another model of the family is patched (the router installed in the modeling
    module): the unpatched model's routed call traces to the original function.
    """
    model = tiny_for("qwen3", num_hidden_layers=1)
    other = tiny_for("qwen3", num_hidden_layers=1)
    ids = torch.randint(0, 256, (1, 8))

    def breaks() -> list[str]:
        torch._dynamo.reset()
        return [b.reason for b in torch._dynamo.explain(model)(input_ids=ids).break_reasons]

    unpatched = breaks()
    with patched(model, patchset=qwen3_patchset()):
        assert breaks() == unpatched
    with patched(other, patchset=qwen3_patchset()):
        assert breaks() == unpatched


def test_kernel_that_is_not_compile_safe_runs_eagerly_and_the_report_says_so() -> None:
    base = tiny_for("qwen3", num_hidden_layers=1)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    eager = copy.deepcopy(base)
    expected_logits, expected_loss = _step(eager, ids)

    # Declared compile-unsafe: the engine wraps it with torch.compiler.disable at apply time.
    model = copy.deepcopy(base)
    with extra_kernel("eager_only", "rms_norm", opaque_rms_norm, compile_safe=False), \
            patched(model, patchset=qwen3_patchset(rms_norm="eager_only")) as (report,):
        assert len(report.compile_disabled) == 5  # input/post-attention/q/k norms + final norm
        assert all("norm" in p for p in report.compile_disabled)
        assert report.to_dict()["compile_disabled"] == report.compile_disabled
        assert "not compile-safe" in str(report)
        logits, loss = _step(torch.compile(model, backend=BACKEND), ids)
    expected_grads = grads(eager)
    assert (logits - expected_logits).abs().max() <= TOL
    assert abs(loss - expected_loss) <= TOL
    assert max_diff(grads(model), expected_grads) <= TOL

    # The same kernel declared compile-safe is not wrapped, and compiling fails: the wrapping is what works.
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    with extra_kernel("eager_only_lying", "rms_norm", opaque_rms_norm, compile_safe=True), \
            patched(model, patchset=qwen3_patchset(rms_norm="eager_only_lying")) as (report,):
        assert report.compile_disabled == []
        with pytest.raises(Exception, match="fake impl"):
            _step(torch.compile(model, backend=BACKEND), ids)
