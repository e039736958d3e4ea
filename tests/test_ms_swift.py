"""ms-swift's own ``swift sft`` with a patchset: ``--external_plugins`` our file, ``--callbacks patch_engine``.

The recipe of docs/training.md, "ms-swift", run for real in-process through ms-swift's entry
point (``swift.pipelines.sft_main``, what ``swift sft`` calls) with the command-line arguments a
user types: its argument parser imports our plugin file by path, its model loader, alpaca
dataset detection, ``qwen3`` template, LoRA wrapping and trainer, on a tiny perturbed Qwen3
saved to a folder, offline, fp32 on the CPU. The unpatched baseline is the same command without
our two arguments. Losses are read from what ``sft_main`` returns (the trainer's log history).

ms-swift 4.6 wants transformers<5.20, so it lives in its own venv: ``.ci/ms-swift`` builds it and
runs this file. In the main venv only the test of the missing-package error runs.
"""

from __future__ import annotations

import gc
import os
import runpy
import sys
from pathlib import Path
from typing import Any, ClassVar

import pytest
from stack_helpers import (
    TRUST,
    LORA_DROPOUT,
    PATCHED_MODULES,
    STEPS,
    assert_one_line,
    assert_same_losses,
    installed,
    launcher_output,
    write_tiny,
    wrong_norms,
)

from engine.errors import MissingDependency, ModelTypeMismatch, PatchsetError, SelfVerificationFailed, VerificationFailed
from engine.integrations import ms_swift
from engine.integrations.ms_swift import CALLBACK_NAME, Settings, plugin_path

HAS_SWIFT = installed("swift")
needs_swift = pytest.mark.skipif(
    not HAS_SWIFT, reason="ms-swift is not installed here; .ci/ms-swift runs this file in its own venv "
    "(ms-swift==4.6.0 wants transformers<5.20)")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model and tokenizer are local folders


def test_the_plugin_path_one_liner_prints_an_importable_file(capsys) -> None:
    """``python -m engine.integrations.ms_swift --plugin-path`` (its ``main``, in-process: no second torch import)."""
    assert ms_swift.main(["--plugin-path"]) == 0
    path = Path(capsys.readouterr().out.strip())
    assert path == plugin_path() and path.is_file()
    assert [p.name for p in path.parent.iterdir() if p.suffix == ".py"] == [path.name]  # alone: shadows nothing


@pytest.mark.skipif(HAS_SWIFT, reason="ms-swift is installed: the missing-package error cannot be seen here")
def test_without_ms_swift_the_plugin_file_names_what_to_install() -> None:
    with pytest.raises(MissingDependency, match=r"needs ms-swift \(swift\.callbacks\): pip install ms-swift"):
        runpy.run_path(str(plugin_path()))


def test_settings_come_from_the_environment_and_a_bad_one_is_named() -> None:
    assert Settings.from_env({}) == Settings(None, False, None)
    assert Settings.from_env({"PATCH_ENGINE_PATCHSET": "qwen3", "PATCH_ENGINE_VERIFY": "sample",
                              "PATCH_ENGINE_FUSED_CROSS_ENTROPY": "0"}) == Settings("qwen3", "sample", False)
    assert Settings.from_env({"PATCH_ENGINE_UNVERIFIED_RELEASE": "refuse"}).unverified_release == "refuse"
    with pytest.raises(ValueError, match="PATCH_ENGINE_UNVERIFIED_RELEASE='sometimes'"):
        Settings.from_env({"PATCH_ENGINE_UNVERIFIED_RELEASE": "sometimes"})
    with pytest.raises(ValueError, match="PATCH_ENGINE_VERIFY='maybe'"):
        Settings.from_env({"PATCH_ENGINE_VERIFY": "maybe"})
    with pytest.raises(PatchsetError, match="no patchset 'qwen3_typo'"):
        Settings.from_env({"PATCH_ENGINE_PATCHSET": "qwen3_typo"})


# --- the real ms-swift -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("ms_swift"))


def _recorder_class() -> type:
    """A ``--callbacks loss_recorder`` that keeps the losses and our callback's report, per run."""
    from swift.callbacks.base import TrainerCallback

    class Recorder(TrainerCallback):
        runs: ClassVar[list[Recorder]] = []

        def __init__(self, args: Any, trainer: Any) -> None:
            super().__init__(args, trainer)
            self.losses: list[float] = []
            self.report = None
            Recorder.runs.append(self)

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            for callback in self.trainer.callback_handler.callbacks:
                if isinstance(callback, ms_swift.SwiftPatchsetCallback):
                    self.report = callback.report

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    return Recorder


def swift_sft(tiny: Path, out: Path, tuner: str, *, patched: bool, env: dict[str, str] | None = None,
              monkeypatch: pytest.MonkeyPatch, steps: int = STEPS) -> Any:
    """``swift sft`` on the tiny model and data, in-process; the run's recorder."""
    from swift.callbacks import callbacks_map
    from swift.pipelines import sft_main

    recorder = _recorder_class()
    callbacks_map["loss_recorder"] = recorder
    for key in ("PATCH_ENGINE_PATCHSET", "PATCH_ENGINE_VERIFY", "PATCH_ENGINE_FUSED_CROSS_ENTROPY"):
        monkeypatch.delenv(key, raising=False)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    argv = [
        "--model", str(tiny / "model"), "--model_type", "qwen3", "--template", "qwen3",
        "--dataset", str(tiny / "data" / "tiny_sft.json"), "--split_dataset_ratio", "0",
        "--tuner_type", tuner, "--torch_dtype", "float32", "--max_length", "64",
        "--max_steps", str(steps), "--logging_steps", "1", "--per_device_train_batch_size", "4",
        "--gradient_accumulation_steps", "1", "--learning_rate", "1e-2", "--lr_scheduler_type", "constant",
        "--warmup_ratio", "0", "--lora_dropout", str(LORA_DROPOUT), "--seed", "0", "--data_seed", "0",
        "--dataloader_num_workers", "0", "--dataset_num_proc", "1", "--save_strategy", "no",
        "--report_to", "none", "--output_dir", str(out), "--load_from_cache_file", "false",
        "--use_hf", "true",  # the hub is Hugging Face's, offline here (HF_HUB_OFFLINE): no ModelScope look-ups
        "--check_model", "false",  # else each run asks ModelScope if the local model is its latest (~20 s offline)
        "--callbacks", "loss_recorder",
    ]
    if patched:
        argv += ["--callbacks", "loss_recorder", CALLBACK_NAME, "--external_plugins", str(plugin_path())]
        sys.modules.pop(_plugin_module_name(), None)  # ms-swift imports a plugin file once per process
    try:
        with launcher_output("swift") as console:  # ms-swift's own handler, at its default level (no LOG_LEVEL)
            sft_main(argv)
    finally:
        gc.collect()  # a patched model holds its function router until collected (conftest explains)
    (run,) = recorder.runs
    run.console = console.getvalue()
    return run


def _plugin_module_name() -> str:
    import hashlib

    return f"_swift_external_{hashlib.sha256(str(plugin_path()).encode()).hexdigest()}"


@pytest.fixture(scope="module")
def baseline(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    runs = {}
    with pytest.MonkeyPatch.context() as monkeypatch:
        for tuner in ("full", "lora"):
            run = swift_sft(tiny, tmp_path_factory.mktemp("baseline"), tuner, patched=False, monkeypatch=monkeypatch)
            assert run.report is None and len(run.losses) == STEPS and "patch-engine" not in run.console
            runs[tuner] = run.losses
    return runs


@needs_swift
@pytest.mark.slow
@pytest.mark.parametrize("tuner", ["full", "lora"])
def test_patched_sft_losses_equal_unpatched(tiny, tmp_path, baseline, tuner, monkeypatch) -> None:
    """No ``PATCH_ENGINE_PATCHSET``: the patchset is the model's ``model_type`` (qwen3); verified; LoRA dropout 0.05."""
    run = swift_sft(tiny, tmp_path, tuner, patched=True, env={"PATCH_ENGINE_VERIFY": "1"}, monkeypatch=monkeypatch)
    assert run.report.patchset == "qwen3" and len(run.report.patched) == PATCHED_MODULES, str(run.report)
    assert run.report.verification.passed and run.report.mode == "training"
    line = assert_one_line(run.console, verified=True)
    assert line.startswith("[INFO:swift] patch-engine: patchset 'qwen3' on qwen3 (cpu, training)"), line
    assert_same_losses(run.losses, baseline[tuner])  # LoRA: dropout 0.05 and verification, bit for bit


@needs_swift
@pytest.mark.slow
def test_a_wrong_declaration_shows_in_the_losses(tiny, tmp_path, baseline, monkeypatch) -> None:
    """The comparison above can fail: with the norms declared ``1 + weight`` the loss of step 1 differs.

    By default that file (the user's own) is verified first and refused before step 1; ``unverified: trust``
    (``$PATCH_ENGINE_UNVERIFIED``) applies it unverified."""
    with pytest.raises(SelfVerificationFailed, match="Qwen3RMSNorm"):
        swift_sft(tiny, tmp_path / "default", "full", patched=True,
                  env={"PATCH_ENGINE_PATCHSET": wrong_norms(tmp_path)}, monkeypatch=monkeypatch, steps=1)
    run = swift_sft(tiny, tmp_path, "full", patched=True, env={"PATCH_ENGINE_PATCHSET": wrong_norms(tmp_path), **TRUST},
                    monkeypatch=monkeypatch, steps=1)  # the first step's loss already differs
    assert len(run.report.patched) == PATCHED_MODULES
    assert abs(run.losses[0] - baseline["full"][0]) > 1e-2, f"wrong norms {run.losses} vs {baseline['full']}"


@needs_swift
def test_verify_stops_a_wrong_declaration_before_step_one(tiny, tmp_path, monkeypatch) -> None:
    from swift.callbacks import callbacks_map

    env = {"PATCH_ENGINE_PATCHSET": wrong_norms(tmp_path), "PATCH_ENGINE_VERIFY": "true"}
    with pytest.raises(VerificationFailed, match="Qwen3RMSNorm"):
        swift_sft(tiny, tmp_path / "out", "full", patched=True, env=env, monkeypatch=monkeypatch)
    (run,) = callbacks_map["loss_recorder"].runs
    assert run.losses == []


@needs_swift
def test_a_patchset_for_another_family_stops_before_step_one(tiny, tmp_path, monkeypatch) -> None:
    from swift.callbacks import callbacks_map

    with pytest.raises(ModelTypeMismatch, match="qwen3"):
        swift_sft(tiny, tmp_path, "full", patched=True, env={"PATCH_ENGINE_PATCHSET": "llama"}, monkeypatch=monkeypatch)
    (run,) = callbacks_map["loss_recorder"].runs
    assert run.losses == []


@needs_swift
def test_a_misspelt_patchset_stops_swift_at_argument_parsing(tiny, tmp_path, monkeypatch) -> None:
    from swift.callbacks import callbacks_map

    with pytest.raises(PatchsetError, match="no patchset 'qwen3_typo'"):
        swift_sft(tiny, tmp_path, "full", patched=True, env={"PATCH_ENGINE_PATCHSET": "qwen3_typo"},
                  monkeypatch=monkeypatch)
    assert callbacks_map["loss_recorder"].runs == []  # no trainer was built
