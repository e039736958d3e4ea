"""Gradient checkpointing, enabled before or after ``apply``: the same gradients.

transformers' ``GradientCheckpointingLayer`` recomputes each decoder layer in backward. The
rope routing context is set by the attention module's (wrapped) forward, which the
recompute runs again, so the recomputed layer calls the kernel too: counted below, and
shown by numbers with a kernel that is deliberately not rope (if the recompute fell back to
the original rope, its activations, and so the gradients, would differ from the forward's).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_for
from training_helpers import extra_kernel, grads, max_diff, patched, qwen3_patchset

from engine.ops.rope import rope_reference

TOL = 1e-5
LAYERS = 2


def _grads(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    return grads(model)


@pytest.mark.parametrize("order", ["checkpointing_then_apply", "apply_then_checkpointing"])
@pytest.mark.parametrize("kernel", ["counting", "skewed"])
def test_checkpointed_patched_model_has_the_same_gradients(order: str, kernel: str) -> None:
    calls: list[int] = []

    def counting(q, k, cos, sin, unsqueeze_dim=1):
        calls.append(1)
        return rope_reference(q, k, cos, sin, unsqueeze_dim)

    def skewed(q, k, cos, sin, unsqueeze_dim=1):
        calls.append(1)
        q, k = rope_reference(q, k, cos, sin, unsqueeze_dim)
        return q * 1.5, k

    base = tiny_for("qwen3")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    unpatched = _grads(copy.deepcopy(base), ids)
    ps = qwen3_patchset(rope=f"ckpt_{kernel}")
    # applied unverified: the skewed kernel is wrong on purpose (verified first, the default, it would be refused),
    # and the calls counted here are the model's own, not those of a verification on a tiny model before it
    trust = {"unverified": "trust"}
    with extra_kernel(f"ckpt_{kernel}", "rope", counting if kernel == "counting" else skewed):
        plain = copy.deepcopy(base)
        with patched(plain, patchset=ps, **trust):
            expected = _grads(plain, ids)  # patched, no checkpointing
        assert len(calls) == LAYERS
        calls.clear()

        model = copy.deepcopy(base)
        if order == "checkpointing_then_apply":
            model.gradient_checkpointing_enable()
        with patched(model, patchset=ps, **trust):
            if order == "apply_then_checkpointing":
                model.gradient_checkpointing_enable()
            assert model.is_gradient_checkpointing
            got = _grads(model, ids)
    assert len(calls) == 2 * LAYERS  # each layer's forward, then its recompute in backward
    assert max_diff(got, expected) <= TOL
    if kernel == "counting":
        assert max_diff(got, unpatched) <= TOL
    else:
        assert max_diff(got, unpatched) > 1e-3  # the skewed kernel is visible, in forward and recompute alike
