"""The default ``engine.apply`` checks each patched class on the user's own modules, at their size.

Every test builds a real tiny transformers model (perturbed weights, no mocks) and judges what
apply did against the unpatched model's own numbers. The check's reason to exist is a class whose
forward depends on what only the real model has: here a norm that switches behaviour at a width
of 256, which every tiny model (64 wide) and every verdict made on one passes.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers.models.qwen3 import modeling_qwen3

import engine
from engine.errors import VerificationFailed, ZeroConfigWarning
from engine.tiny import build_tiny_model
from engine.verification import real_modules
from engine.verification.real_modules import STRUCTURED, check_real_modules


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh verdict cache on disk and a cold in-process outcome cache per test."""
    monkeypatch.setenv("PATCH_ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    real_modules.clear_cache()


class Qwen3RMSNorm(modeling_qwen3.Qwen3RMSNorm):
    """A user's norm with transformers' class name whose forward switches at a width of 256 (the tiny copy's is 64)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = super().forward(hidden_states)
        if hidden_states.shape[-1] >= 256:  # e.g. a wide model's own rescaling
            return out * 1.5
        return out


class StraightThroughNorm(modeling_qwen3.Qwen3RMSNorm):
    """Forward exactly Qwen3's; at a width of 256, its input's gradient is passed straight through (its own).

    Only a backward comparison at the real width can tell: the values are the original's bit for bit.
    """

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.shape[-1] < 256:
            return super().forward(hidden_states)
        return super().forward(hidden_states.detach()) + (hidden_states - hidden_states.detach())


StraightThroughNorm.__name__ = StraightThroughNorm.__qualname__ = "Qwen3RMSNorm"


def _with_norm(model: nn.Module, cls: type) -> nn.Module:
    """``model`` with every Qwen3 norm an instance of ``cls`` (same weights): the user's own class."""
    for module in model.modules():
        if type(module) is modeling_qwen3.Qwen3RMSNorm:
            module.__class__ = cls
    return model


def _wide() -> nn.Module:
    return _with_norm(build_tiny_model("qwen3", {"hidden_size": 256}), Qwen3RMSNorm)


def _logits(model: nn.Module) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(input_ids=ids).logits


def _patched(module: nn.Module) -> bool:
    return "forward" in module.__dict__


def test_a_width_branch_refuses_a_named_patchset_and_leaves_the_model_as_it_was() -> None:
    model = _wide()
    before = _logits(model)
    with pytest.raises(VerificationFailed) as caught:
        engine.apply(model, "qwen3")
    message = str(caught.value)
    assert "model.layers.0.input_layernorm" in message and "Qwen3RMSNorm" in message, message
    assert "fp32" in message and "max abs" in message and "rows" in message, message
    assert not engine.is_patched(model)
    assert not any(_patched(m) for m in model.modules())
    assert torch.equal(_logits(model), before)


def test_a_width_branch_is_left_unpatched_by_zero_configuration() -> None:
    model = _wide()
    before = _logits(model)
    with pytest.warns(ZeroConfigWarning, match="input_layernorm"):
        report = engine.apply(model)
    assert engine.is_patched(model)
    norms = [m for m in model.modules() if type(m) is Qwen3RMSNorm]
    mlps = [m for m in model.modules() if type(m).__name__ == "Qwen3MLP"]
    assert norms and not any(_patched(m) for m in norms)
    assert mlps and all(_patched(m) for m in mlps)
    assert any("Qwen3RMSNorm" in line and "your own module" in line for line in report.zero_config.not_patched)
    assert report.real_modules.passed and report.real_modules.left_unpatched
    assert "left unpatched" in str(report)
    after = _logits(model)
    assert (after - before).abs().max().item() <= 1e-5  # the MLPs' kernel, within fp32 rounding of the original


def test_zero_configuration_strict_refuses_instead() -> None:
    model = _wide()
    with pytest.raises(VerificationFailed, match="input_layernorm"):
        engine.apply(model, strict=True)
    assert not engine.is_patched(model)


def test_a_stock_model_passes_and_a_second_one_is_served_from_the_cache() -> None:
    model = build_tiny_model("qwen3")
    twin = copy.deepcopy(model)
    grads_before = [p.grad for p in model.parameters()]
    state = torch.random.get_rng_state()
    report = engine.apply(model, "qwen3")
    assert torch.equal(torch.random.get_rng_state(), state)  # no random state moved
    assert [p.grad for p in model.parameters()] == grads_before  # the user's .grad untouched (None)
    found = report.real_modules
    assert found.passed and not found.skipped
    assert {m.cls for m in found.checked} == {"Qwen3RMSNorm", "Qwen3MLP"}
    # one instance per class and parameter shape: the norm at the head width (q_norm) and at the hidden width
    assert {(m.cls, m.width) for m in found.checked} == {("Qwen3RMSNorm", 16), ("Qwen3RMSNorm", 64), ("Qwen3MLP", 64)}
    assert all(m.lengths == (1, 17, 129) and m.dtypes == ("fp32",) and m.backward for m in found.checked)
    assert not any(m.cached for m in found.checked)
    assert any("rope" in what and why == STRUCTURED for what, why in found.not_checked)
    assert "checked on your own modules: 3 passed" in str(report)
    assert report.to_dict()["real_modules"]["checked"][0]["lengths"] == (1, 17, 129)
    again = engine.apply(twin, "qwen3").real_modules
    assert again.passed and all(m.cached for m in again.checked)
    assert [m.path for m in again.checked] == [m.path for m in found.checked]


def test_a_bf16_model_is_checked_in_bf16_in_place() -> None:
    model = build_tiny_model("qwen3", dtype=torch.bfloat16)
    found = engine.apply(model, "qwen3").real_modules
    assert found.passed and {m.dtypes for m in found.checked} == {("bf16",)}


def test_a_gradient_of_its_own_is_caught_in_training_and_not_in_inference() -> None:
    model = _with_norm(build_tiny_model("qwen3", {"hidden_size": 256}), StraightThroughNorm)
    with pytest.raises(VerificationFailed, match=r"input_layernorm .*backward in fp32 at 17 rows"):
        engine.apply(model, "qwen3")
    assert not engine.is_patched(model)
    model.eval()  # inference: no backward runs, so the forward, which is exactly Qwen3's, is all there is
    found = engine.apply(model, "qwen3").real_modules
    assert found.passed and not any(m.backward for m in found.checked)


def test_trust_and_check_modules_false_skip_the_check() -> None:
    model = _wide()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trusted = engine.apply(model, "qwen3", unverified="trust")
    assert trusted.real_modules.skipped.startswith("unverified='trust'") and not trusted.real_modules.checked
    assert "not checked on your own modules" in str(trusted)
    engine.revert(model)
    off = engine.apply(model, "qwen3", check_modules=False)
    assert off.real_modules.skipped == "check_modules=False"
    assert engine.is_patched(model)


def test_a_module_on_the_meta_device_is_named_not_checked() -> None:
    model = build_tiny_model("qwen3")
    report = engine.apply(model, "qwen3", check_modules=False)
    model.model.layers[1].mlp.to("meta")
    found = check_real_modules(model, report, cache=False)
    assert found.passed
    assert ("Qwen3MLP (swiglu) at model.layers.1.mlp",) == tuple(
        what for what, why in found.not_checked if "meta device" in why)
    assert "model.layers.0.mlp" in [m.path for m in found.checked]
