"""PEFT LoRA with a patched model, in both orders: the base modules are patched, the adapters train.

``engine.apply`` accepts the ``PeftModel`` and patches the transformers model inside it (the
patch state lives there), so ``get_peft_model`` then ``apply`` and ``apply`` then
``get_peft_model`` give the same model. swiglu's forward calls the projections as modules,
so LoRA on gate/up/down stays in the computation: the adapters below start non-zero
(``init_lora_weights=False``), so dropping them would change the numbers.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_for
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import Linear as LoraLinear
from safetensors.torch import load_file
from training_helpers import qwen3_patchset

import engine

TOL = 1e-5
STEPS = 5
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(1234)  # the same adapter init in every run
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=TARGETS,
                                            init_lora_weights=False, task_type="CAUSAL_LM"))


def _train(model: torch.nn.Module, ids: torch.Tensor) -> list[float]:
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _adapter(model: torch.nn.Module, path) -> dict[str, torch.Tensor]:
    model.save_pretrained(path)
    return load_file(path / "adapter_model.safetensors")


@pytest.mark.parametrize("order", ["peft_then_apply", "apply_then_peft"])
def test_lora_on_a_patched_model_trains_like_unpatched(order: str, tmp_path) -> None:
    base = tiny_for("qwen3")
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))

    reference = _peft(copy.deepcopy(base))
    with torch.no_grad():
        base_only = base(input_ids=ids).logits
        ref_logits = reference(input_ids=ids).logits
    assert (ref_logits - base_only).abs().max() > 1e-3  # the adapters contribute from the start
    ref_losses = _train(reference, ids)
    ref_adapter = _adapter(reference, tmp_path / "unpatched")

    inner = copy.deepcopy(base)
    if order == "peft_then_apply":
        model = _peft(inner)
        report = engine.apply(model, qwen3_patchset(), device="cpu", mode="training")
    else:
        report = engine.apply(inner, qwen3_patchset(), device="cpu", mode="training")
        model = _peft(inner)
    try:
        assert engine.is_patched(model) and engine.is_patched(inner)  # one state, on the transformers model
        assert engine.apply(model, qwen3_patchset(), device="cpu", mode="training") is report  # patched once
        assert len(report.patched) == 12 and not any(p.startswith("base_model") for p in report.patched)
        mlp = inner.model.layers[0].mlp
        assert "forward" in mlp.__dict__ and isinstance(mlp.gate_proj, LoraLinear)
        with torch.no_grad():
            assert (model(input_ids=ids).logits - ref_logits).abs().max() <= TOL  # LoRA inside swiglu counts
        losses = _train(model, ids)
        adapter = _adapter(model, tmp_path / "patched")
    finally:
        assert engine.revert(model) is True
    assert not engine.is_patched(inner)
    assert losses[-1] < losses[0] - 0.1, losses
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= TOL, (losses, ref_losses)
    assert sorted(adapter) == sorted(ref_adapter)
    assert all("lora_" in k for k in adapter)
    assert max((adapter[k] - ref_adapter[k]).abs().max().item() for k in adapter) <= TOL
    # the base weights were frozen in both runs
    frozen = {n.replace(".base_layer", ""): p for n, p in inner.named_parameters() if "lora_" not in n}
    original = dict(base.named_parameters())
    assert frozen.keys() == original.keys()
    assert all(not p.requires_grad and torch.equal(p, original[n]) for n, p in frozen.items())
