"""Nothing a user wrote breaks when the engine's modules move: a model pickled before the move loads.

``tests/fixtures/premove_patched_qwen3.pt`` is a tiny patched Qwen3 saved whole (``torch.save(model)``)
by the engine before its modules moved into layer packages (made by
``tests/fixtures/make_premove_pickle.py``); its pickle names the old module paths. Loaded by today's
engine it must be patched, compute the unpatched model's numbers (fp32, 1e-5), train (a backward),
and revert exactly.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

import engine

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "premove_patched_qwen3.pt"
TOL = 1e-5


def _load_premove() -> tuple[dict, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = torch.load(FIXTURE, weights_only=False)
    return saved, list(caught)


def test_a_model_pickled_before_the_move_loads_patched_and_computes_the_unpatched_numbers() -> None:
    saved, caught = _load_premove()
    model, ids = saved["model"], saved["input_ids"]
    assert engine.is_patched(model)
    deprecations = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert all("moved to" in message for message in deprecations), deprecations
    out = model(input_ids=ids, labels=ids)
    assert (out.logits.detach() - saved["unpatched_logits"]).abs().max().item() <= TOL
    assert abs(out.loss.item() - saved["unpatched_loss"].item()) <= TOL
    out.loss.backward()
    patched_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert patched_grads and all(g.isfinite().all() for g in patched_grads.values())

    assert engine.revert(model) is True
    assert all("forward" not in m.__dict__ for m in model.modules())
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    assert (out.logits.detach() - saved["unpatched_logits"]).abs().max().item() <= TOL
    out.loss.backward()
    for name, grad in patched_grads.items():  # the patched backward was the unpatched one's
        assert (grad - dict(model.named_parameters())[name].grad).abs().max().item() <= TOL, name
