"""With Hugging Face's ``kernels`` package installed, the engine reads functions through its wrappers.

transformers 5.20 with ``kernels`` 0.17 turns every function decorated ``use_kernel_forward_from_hub``
(``apply_rotary_pos_emb`` of most families, and the hub-bound linear-attention helpers) into an
instance of a ``kernels`` ``Func`` module at import: ``inspect.signature`` of it is
``(*args, **kwargs)`` and its source is not the function's. These tests run where that wrapping
happens (CI: ``.ci/matrix`` runs this file under its ``transformers 5.20.1 + kernels 0.17.2``
layer) and are skipped elsewhere, saying why. Every bundled patchset verifying there is the
matrix's ``kernels`` column (docs/compatibility.md).
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

from engine.foundation.see_through import kernels_function, see_through
from engine.runtime import routing

pytestmark = pytest.mark.skipif(importlib.util.find_spec("kernels") is None, reason="HF `kernels` is not installed")

ROPE_MODULE = "transformers.models.qwen3.modeling_qwen3"


@pytest.fixture(scope="module")
def wrapped_rope():
    """Qwen3's ``apply_rotary_pos_emb`` as transformers left it: a ``kernels`` ``Func`` module."""
    from transformers.models.qwen3 import modeling_qwen3 as m

    fn = m.apply_rotary_pos_emb
    if kernels_function(fn) is None:
        import transformers

        pytest.skip(f"transformers {transformers.__version__} does not wrap functions in kernels' Func here")
    return fn


@pytest.fixture
def tiny_qwen3():
    from engine.tiny import build_tiny_model

    return build_tiny_model("qwen3", {}, seed=0)


def test_the_wrapper_hides_the_function_and_see_through_finds_it(wrapped_rope) -> None:
    from engine.foundation.drift import signature_text
    from engine.runtime.hub_functions import torch_body

    assert isinstance(wrapped_rope, torch.nn.Module)
    assert str(inspect.signature(wrapped_rope)) == "(*args, **kwargs)"  # what the engine used to read
    body = see_through(wrapped_rope)
    assert inspect.isfunction(body) and body.__module__ == ROPE_MODULE
    assert str(inspect.signature(body)) == "(q, k, cos, sin, unsqueeze_dim=1)"
    assert inspect.getsource(body).lstrip().startswith(("def apply_rotary_pos_emb", "@"))
    assert signature_text(wrapped_rope) == "(q, k, cos, sin, unsqueeze_dim=1)"
    assert torch_body(wrapped_rope) is body


def test_rope_routes_to_our_kernel_and_reverts_to_the_wrapper_object(wrapped_rope, tiny_qwen3) -> None:
    from transformers.models.qwen3 import modeling_qwen3 as m

    import engine

    ids = torch.randint(0, tiny_qwen3.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = tiny_qwen3(input_ids=ids).logits
    report = engine.apply(tiny_qwen3, "qwen3", device="cpu")
    rope = [d for d in report.decisions if d.op == "rope"]
    assert rope and all(d.action == "patch" for d in rope)
    router = routing.router_for(ROPE_MODULE, "apply_rotary_pos_emb")
    assert router is not None and router.original is wrapped_rope
    assert m.apply_rotary_pos_emb is router.function
    assert str(inspect.signature(m.apply_rotary_pos_emb)) == "(q, k, cos, sin, unsqueeze_dim=1)"
    active: list[object] = []
    router.observers.append(lambda args, kwargs: active.append(router.active.get()))
    try:
        with torch.no_grad():
            after = tiny_qwen3(input_ids=ids).logits
    finally:
        router.observers.clear()
    assert len(active) == tiny_qwen3.config.num_hidden_layers
    assert all(impl is not None and impl is not wrapped_rope for impl in active)  # our kernel, every layer
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)
    engine.revert(tiny_qwen3)
    assert m.apply_rotary_pos_emb is wrapped_rope  # the very object transformers put there
    assert routing.router_for(ROPE_MODULE, "apply_rotary_pos_emb") is None


def test_verify_qwen3_passes_under_the_wrapper(wrapped_rope) -> None:
    from engine.commands.coverage import verify_patchset

    passed, note = verify_patchset("qwen3")
    assert passed, note


def test_the_scaffold_sees_the_wrapped_rope(wrapped_rope, tiny_qwen3) -> None:
    from engine.scaffolding.capture import model_functions

    found = model_functions(tiny_qwen3)
    assert found.get((ROPE_MODULE, "apply_rotary_pos_emb")) is wrapped_rope


def test_hub_bound_functions_are_seen_through_the_wrapper() -> None:
    """transformers wraps its own hub-fallback wrapper in a ``Func`` as well (linear attention)."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    from engine.runtime.hub_functions import hub_binding, torch_body

    fn = m.torch_chunk_gated_delta_rule
    if kernels_function(fn) is None:
        pytest.skip("this transformers does not wrap its hub-bound functions in kernels' Func")
    binding = hub_binding(fn)
    assert binding is not None
    assert binding[0].__name__ == "torch_chunk_gated_delta_rule" and binding[0].__module__ == m.__name__
    assert torch_body(fn) is binding[0]
