"""LlamaFactory's own SFT, with a patchset through examples/llamafactory/train_with_patchset.py.

The recipe a LlamaFactory user follows (docs/training.md, "LlamaFactory"): their YAML plus a
``patchset:`` key, run by our launcher, which calls LlamaFactory's ``run_exp`` with a
``PatchsetCallback``. Everything below runs LlamaFactory for real (its argument parser, its
alpaca loader and qwen3 template, its LoRA wrapping, its ``CustomSeq2SeqTrainer``) on a tiny
Qwen3 saved to a folder with ``save_pretrained`` and a tokenizer built here, offline, in fp32
on the CPU. The unpatched baseline is the same launcher and YAML with ``patchset=null``.

LlamaFactory pins transformers<=5.6.0, trl<=0.24, peft<=0.18.1, so it lives in its own venv:
``.ci/llamafactory`` builds it and runs this file; in the main venv the file is skipped.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ROOT
from stack_helpers import (
    TRUST,
    LORA_DROPOUT,
    PATCHED_MODULES,
    STEPS,
    LossRecorder,
    assert_one_line,
    assert_same_losses,
    write_tiny,
    wrong_norms,
)

from engine.errors import ModelTypeMismatch, PatchsetError, SelfVerificationFailed, VerificationFailed

pytest.importorskip(
    "llamafactory",
    reason="LlamaFactory is not installed here; .ci/llamafactory runs this file in its own venv "
    "(llamafactory==0.9.5 pins transformers<=5.6.0, trl<=0.24, peft<=0.18.1)",
)
# The model and tokenizer are local folders; .ci/llamafactory also sets it before Python starts.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

EXAMPLE = ROOT / "examples" / "llamafactory"
CONFIG = EXAMPLE / "qwen3_lora_sft_patched.yaml"

sys.path.insert(0, str(EXAMPLE))
launcher = importlib.import_module("train_with_patchset")  # examples/llamafactory/train_with_patchset.py



@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("llamafactory"))


def train(
    tiny: Path, tmp_path: Path, patchset: str | None, recorder: LossRecorder | None = None, **overrides: Any,
) -> tuple[list[float], list[Any]]:
    """Our launcher on the example YAML, pointed at the tiny model and data; (losses, patchset callbacks)."""
    settings = {
        "patchset": patchset, "model_name_or_path": tiny / "model", "dataset_dir": tiny / "data",
        "dataset": "tiny_sft", "output_dir": tmp_path / "out", "max_steps": STEPS, "logging_steps": 1,
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "learning_rate": 1e-2,
        "lr_scheduler_type": "constant", "warmup_steps": 0, "bf16": False,
        "cutoff_len": 64, "max_samples": 16, "preprocessing_num_workers": None, "dataloader_num_workers": 0,
        "plot_loss": False, "seed": 0, **overrides,
    }
    if settings.get("finetuning_type") == "lora":  # LlamaFactory's default is 0; users run PEFT's 0.05
        settings.setdefault("lora_dropout", LORA_DROPOUT)
    argv = [str(CONFIG), *(f"{k}={'null' if v is None else v}" for k, v in settings.items())]
    recorder = recorder or LossRecorder()
    ours = launcher.main(argv, callbacks=[recorder])
    gc.collect()  # a patched model holds its function router until collected (conftest explains)
    return recorder.losses, ours


@pytest.fixture(scope="module")
def baseline(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    """Unpatched losses per finetuning type: the same launcher and YAML with ``patchset=null``."""
    runs = {}
    for finetuning_type in ("full", "lora"):
        losses, ours = train(tiny, tmp_path_factory.mktemp("baseline"), None, finetuning_type=finetuning_type)
        assert ours == [] and len(losses) == STEPS
        runs[finetuning_type] = losses
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("finetuning_type", ["full", "lora"])
def test_patched_sft_losses_equal_unpatched(tiny, tmp_path, baseline, finetuning_type, capsys) -> None:
    losses, (callback,) = train(tiny, tmp_path, "qwen3", finetuning_type=finetuning_type, patchset_verify=True)
    assert len(callback.report.patched) == PATCHED_MODULES, str(callback.report)
    # LlamaFactory's default output on stdout: its own INFO logs, the Trainer's printed losses, and our line
    assert assert_one_line(capsys.readouterr().out, verified=True).startswith("patch-engine: patchset 'qwen3' on qwen3")
    assert callback.report.verification.passed  # patchset_verify: each module against its original, once
    assert callback.report.mode == "training"
    assert_same_losses(losses, baseline[finetuning_type])  # LoRA: dropout 0.05 and verification, bit for bit



@pytest.mark.slow
def test_a_wrong_declaration_shows_in_the_losses(tiny, tmp_path, baseline, monkeypatch) -> None:
    """The comparison above can fail: the patched kernels are what LlamaFactory trains with.

    The same patchset read from a file, with Qwen3's ``weight`` norms declared as ``1 + weight``. By
    default (no option set) a file of the user's own is verified first and refused before step 1;
    applied with ``unverified: trust``, the loss of the first step already differs.
    """
    recorder = LossRecorder()
    with pytest.raises(SelfVerificationFailed, match="Qwen3RMSNorm"):
        train(tiny, tmp_path, wrong_norms(tmp_path), recorder, finetuning_type="full", max_steps=1)
    assert recorder.losses == []
    for name, value in TRUST.items():
        monkeypatch.setenv(name, value)
    losses, (callback,) = train(tiny, tmp_path, wrong_norms(tmp_path), finetuning_type="full", max_steps=1)
    assert len(callback.report.patched) == PATCHED_MODULES
    assert abs(losses[0] - baseline["full"][0]) > 1e-2, f"wrong norms {losses} vs unpatched {baseline['full']}"


def test_patchset_verify_stops_a_wrong_declaration_before_step_one(tiny, tmp_path) -> None:
    """``patchset_verify: true`` catches the same wrong patchset when the trainer is built: no step is taken."""
    recorder = LossRecorder()
    with pytest.raises(VerificationFailed, match="Qwen3RMSNorm"):
        train(tiny, tmp_path, wrong_norms(tmp_path), recorder, finetuning_type="full", patchset_verify=True)
    assert recorder.losses == []
    gc.collect()


def test_a_patchset_for_another_family_stops_before_step_one(tiny, tmp_path) -> None:
    """``patchset: llama`` on a Qwen3 checkpoint: refused when the trainer is built, no step taken."""
    recorder = LossRecorder()
    with pytest.raises(ModelTypeMismatch, match="qwen3"):
        train(tiny, tmp_path, "llama", recorder, finetuning_type="full")
    assert recorder.losses == []
    gc.collect()


def test_a_misspelt_patchset_stops_before_llamafactory_loads_anything(tmp_path) -> None:
    recorder = LossRecorder()
    argv = [str(CONFIG), "patchset=qwen3_typo", f"output_dir={tmp_path}"]
    with pytest.raises(PatchsetError, match="no patchset 'qwen3_typo'.*bundled patchsets: .*qwen3"):
        launcher.main(argv, callbacks=[recorder])
    assert recorder.losses == [] and not any(tmp_path.iterdir())


def test_llamafactory_alone_refuses_our_keys(tmp_path) -> None:
    """Why a launcher: ``llamafactory-cli train`` on the example YAML stops at our keys (LlamaFactory's parser)."""
    from llamafactory.hparams import get_train_args

    config = {**yaml.safe_load(CONFIG.read_text()), "bf16": False, "output_dir": str(tmp_path)}  # no bf16 on CPU
    with pytest.raises(ValueError, match=r"not used by the HfArgumentParser: \['patchset', 'patchset_verify'\]"):
        get_train_args(config)
