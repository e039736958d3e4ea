"""twinkle's own training path with a patchset: ``model.apply_patch(PatchsetPatch(...))`` and ``kernelize``.

Runs twinkle for real: ``TransformersModel`` built from a tiny perturbed Qwen3 folder (the one
tests/stack_helpers.py writes), its LoRA (``add_adapter_to_model``), its accelerate strategy,
``forward_backward`` (its InputProcessor, its loss, its backward) and ``clip_grad_and_step``
(its AdamW), fp32 on the CPU, on pre-tokenized ``InputFeature`` rows (twinkle's encoded-batch
input). The unpatched baseline is the same loop without the patch.

**A CPU shim, and only one**: twinkle has no CPU platform. ``Platform.get_platform`` falls back
to its ``GPU`` platform when no ``nvidia-smi``/``npu-smi`` is found, and ``GPU.get_local_device``
answers ``cuda:0``, where the InputProcessor moves every batch. The ``cpu_platform`` fixture
replaces ``Platform.get_platform`` with a ``GPU`` subclass whose device is ``cpu`` (backend
``gloo``); nothing else of twinkle is replaced.

twinkle-kit 0.5.1 pins peft<=0.19, numpy<2.3 and (through modelscope[framework]) datasets<=4.8.4,
so it lives in its own venv: ``.ci/twinkle`` builds it and runs this file; skipped elsewhere.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.errors import PatchsetError, SelfVerificationFailed, TrainerConflict, VerificationFailed

pytest.importorskip("twinkle", reason="twinkle is not installed here; .ci/twinkle runs this file in its own venv "
                    "(twinkle-kit==0.5.1 pins peft<=0.19, numpy<2.3)")
from stack_helpers import (
    TRUST,
    LORA_DROPOUT,
    PATCHED_MODULES,
    STEPS,
    alpaca_rows,
    assert_one_line,
    assert_same_losses,
    launcher_output,
    write_tiny,
    wrong_norms,
)

import engine
from engine.integrations.twinkle import PatchsetPatch, kernel_mapping


@pytest.fixture(scope="module", autouse=True)
def cpu_platform() -> Iterator[None]:
    """The CPU shim (see the module docstring): twinkle's device becomes ``cpu``, nothing else changes."""
    from twinkle.utils.platforms.base import Platform
    from twinkle.utils.platforms.gpu import GPU

    class CPU(GPU):
        @staticmethod
        def device_prefix() -> str:
            return "cpu"

        @staticmethod
        def get_local_device(idx: int = 0, **kwargs: Any) -> str:
            return "cpu"

        @staticmethod
        def device_backend(platform: str | None = None) -> str:
            return "gloo"

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Platform, "get_platform", staticmethod(lambda platform=None: CPU))
        yield


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("twinkle"))


def batches(folder: Path) -> list[list[dict[str, list[int]]]]:
    """Four batches of four alpaca rows, tokenized: twinkle ``InputFeature`` lists (labels = inputs)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder / "model")
    rows = [tokenizer(f"{r['instruction']} {r['output']}")["input_ids"] for r in alpaca_rows()]
    features = [{"input_ids": ids, "labels": ids, "attention_mask": [1] * len(ids)} for ids in rows]
    return [features[i:i + 4] for i in range(0, 4 * STEPS, 4)]


def build(folder: Path, *, lora: bool) -> Any:
    """A twinkle ``TransformersModel`` from the folder, with its LoRA adapter when asked, and AdamW."""
    import torch
    from peft import LoraConfig
    from twinkle.model import TransformersModel

    torch.manual_seed(0)  # LoRA's initialisation, and its dropout masks in training
    model = TransformersModel(model_id=str(folder / "model"), mixed_precision="no")
    if lora:
        model.add_adapter_to_model("default", LoraConfig(r=8, lora_alpha=16, lora_dropout=LORA_DROPOUT,
                                                         target_modules="all-linear"))
    model.set_optimizer("AdamW", lr=1e-2)
    return model


def train(model: Any, folder: Path, steps: int = STEPS) -> list[float]:
    """twinkle's loop: ``forward_backward`` then ``clip_grad_and_step``; the loss of each step."""
    losses = [float(model.forward_backward(inputs=batch)["loss"]) for batch in _steps(model, folder, steps)]
    gc.collect()  # a patched model holds its function router until collected (conftest explains)
    return losses


def _steps(model: Any, folder: Path, steps: int):
    for batch in batches(folder)[:steps]:
        yield batch
        model.clip_grad_and_step()


@pytest.fixture(scope="module")
def baseline(tiny: Path) -> dict[str, list[float]]:
    return {kind: train(build(tiny, lora=kind == "lora"), tiny) for kind in ("full", "lora")}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_apply_patch_losses_equal_unpatched(tiny, baseline, kind) -> None:
    """``model.apply_patch(PatchsetPatch("qwen3", verify=True))``: after the adapter for LoRA (dropout 0.05)."""
    model = build(tiny, lora=kind == "lora")
    patch = PatchsetPatch("qwen3", verify=True)
    with launcher_output("twinkle") as console:  # twinkle's own handler, at its default level (no LOG_LEVEL)
        model.apply_patch(patch)
    assert len(patch.report.patched) == PATCHED_MODULES and patch.report.mode == "training"
    assert patch.report.verification.passed
    line = assert_one_line(console.getvalue(), verified=True)
    assert "[INFO:twinkle] patch-engine: patchset 'qwen3' on qwen3 (cpu, training)" in line, line  # after its time
    assert_same_losses(train(model, tiny), baseline[kind])


@pytest.mark.slow
def test_kernelize_entry_losses_equal_unpatched(tiny, baseline) -> None:
    """``kernelize(model.model, kernel_mapping())``: the entry's installer applies the model_type's patchset."""
    from twinkle.kernel import kernelize

    model = build(tiny, lora=False)
    mapping = kernel_mapping()
    kernelize(model.model, mapping)
    report = mapping["patch_engine"].installer.patch.report
    assert report.patchset == "qwen3" and len(report.patched) == PATCHED_MODULES
    assert_same_losses(train(model, tiny), baseline["full"])


def test_a_wrong_declaration_is_refused_before_step_one(tiny, tmp_path) -> None:
    """``verify=True`` refuses the flipped ``scale`` in ``apply_patch``, and leaves the model unpatched."""
    model = build(tiny, lora=False)
    with pytest.raises(VerificationFailed, match="Qwen3RMSNorm"):
        model.apply_patch(PatchsetPatch(wrong_norms(tmp_path), verify=True))
    assert not engine.is_patched(model.model)


@pytest.mark.slow
def test_a_wrong_declaration_shows_in_the_losses(tiny, tmp_path, baseline, monkeypatch) -> None:
    """The equality above can fail: by default the flipped ``scale`` (a file of the user's own) is verified first and
    refused; applied unverified (``unverified: trust``) it trains with other losses from step 1."""
    model = build(tiny, lora=False)
    with pytest.raises(SelfVerificationFailed, match="Qwen3RMSNorm"):
        model.apply_patch(PatchsetPatch(wrong_norms(tmp_path)))
    assert not engine.is_patched(model.model)
    for name, value in TRUST.items():
        monkeypatch.setenv(name, value)
    model.apply_patch(PatchsetPatch(wrong_norms(tmp_path)))
    losses = train(model, tiny, steps=1)  # the first step's loss already differs
    assert abs(losses[0] - baseline["full"][0]) > 1e-3 * baseline["full"][0], f"{losses} vs {baseline['full']}"


def test_apply_context_reverts_with_unpatch(tiny) -> None:
    """twinkle's ``apply_context`` calls ``unpatch`` on exit: the model is the unpatched one again."""
    from twinkle.patch import apply_context

    model = build(tiny, lora=False)
    norm = model.model.model.norm
    before = norm.forward
    with apply_context(model.model, PatchsetPatch("qwen3")):
        assert engine.is_patched(model.model) and norm.forward != before
    assert not engine.is_patched(model.model) and norm.forward == before


def test_the_class_with_keywords_as_twinkle_passes_them(tiny) -> None:
    """``model.apply_patch(PatchsetPatch, patchset=...)``: twinkle builds the class bare and passes the keywords."""
    model = build(tiny, lora=False)
    model.apply_patch(PatchsetPatch, patchset="qwen3", verify=True)
    assert engine.is_patched(model.model)
    engine.revert(model.model)


@pytest.mark.parametrize("make", [PatchsetPatch, kernel_mapping])
def test_a_misspelt_patchset_fails_when_made(make) -> None:
    with pytest.raises(PatchsetError, match="no patchset 'qwen3_typo'"):
        make("qwen3_typo")


def test_the_unverified_release_setting_is_checked_when_made() -> None:
    with pytest.raises(ValueError, match=r"PatchsetPatch\(unverified_release=...\)='sometimes'"):
        PatchsetPatch("qwen3", unverified_release="sometimes")
    assert PatchsetPatch("qwen3", unverified_release="refuse").unverified_release == "refuse"


def test_the_fused_head_is_refused() -> None:
    with pytest.raises(TrainerConflict, match="fused_lm_ce"):
        PatchsetPatch("qwen3", fused_cross_entropy=True)
