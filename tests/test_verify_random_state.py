"""Verification leaves every random state as it found it (engine/verification/random_state.py).

A LoRA fine-tune with dropout draws new masks every step from torch's global generator; had
``apply(..., verify=True)`` moved it, the patched run would train on other masks than the
unpatched one and its losses would differ from step 2 on. Real PEFT, a real tiny Qwen3.
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
from conftest import tiny_for
from peft import LoraConfig, get_peft_model

import engine

STEPS = 4


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(1234)  # the same adapter init in every run
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.05, target_modules="all-linear",
                        init_lora_weights=False, task_type="CAUSAL_LM")
    return get_peft_model(model, config).train()


def _run(base: torch.nn.Module, patch: dict | None) -> list[torch.Tensor]:
    """Seed, (maybe) apply, then train: the losses of every step, as tensors (compared bit for bit)."""
    model = _lora(copy.deepcopy(base))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(7)  # the training's dropout stream starts here, in every run
    if patch is not None:
        engine.apply(model, "qwen3", device="cpu", mode="training", **patch)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    losses = []
    try:
        for _ in range(STEPS):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach().clone())
    finally:
        if patch is not None:
            engine.revert(model)
    return losses


def test_a_lora_dropout_run_with_verify_equals_the_unpatched_run_bit_for_bit() -> None:
    base = tiny_for("qwen3")
    unpatched = _run(base, None)
    verified = _run(base, {"verify": True})
    assert len({round(float(x), 6) for x in unpatched}) == STEPS  # the run trains: a wrong mask would show
    for step, (a, b) in enumerate(zip(unpatched, verified), 1):
        assert torch.equal(a, b), f"step {step}: unpatched {a.item()!r}, patched with verify=True {b.item()!r}"


def test_apply_and_verify_leave_the_random_states_unmoved() -> None:
    model = _lora(copy.deepcopy(tiny_for("qwen3")))
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    before = torch.get_rng_state(), random.getstate(), np.random.get_state()
    engine.apply(model, "qwen3", device="cpu", mode="training", verify=True)
    engine.revert(model)
    engine.verify(model, "qwen3", mode="training", check_model=False)  # the patch-verify-revert form
    assert torch.equal(torch.get_rng_state(), before[0])
    assert random.getstate() == before[1]
    after = np.random.get_state()
    assert after[0] == before[2][0] and np.array_equal(after[1], before[2][1]) and after[2:] == before[2][2:]
    # and the generator still works as a generator: the next draw is the one a fresh seed(3) gives
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.set_rng_state(before[0])
    assert torch.equal(torch.rand(4), expected)


def test_the_state_is_restored_when_verification_raises() -> None:
    model = tiny_for("qwen3")
    before = torch.get_rng_state()
    with pytest.raises(ValueError):
        engine.verify(model, "qwen3", modules="some")  # a bad option, after the model was patched
    assert torch.equal(torch.get_rng_state(), before)
    assert not engine.is_patched(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_generators_are_kept() -> None:
    model = tiny_for("qwen3").cuda().train()
    before = torch.cuda.get_rng_state_all()
    engine.apply(model, "qwen3", mode="training", verify=True)
    engine.revert(model)
    assert all(torch.equal(a, b) for a, b in zip(before, torch.cuda.get_rng_state_all()))
