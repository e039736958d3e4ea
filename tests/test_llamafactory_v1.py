"""LlamaFactory's v1 SFT (``USE_V1=1``) with the ``patch_engine`` kernel plugin, through our launcher.

The recipe of docs/training.md ("LlamaFactory v1"): the user's v1 YAML with
``kernel_config: {name: patch_engine, ...}``, run by ``python -m engine.integrations.llamafactory
sft cfg.yaml``, which registers the plugin and runs LlamaFactory's own v1 entry point. Everything
below runs LlamaFactory v1 for real (its ``get_args``, ``DataEngine`` with the alpaca converter,
``qwen3_nothink`` renderer, ``ModelEngine`` with its LoRA plugin, ``SFTTrainer.fit``) on a tiny
perturbed Qwen3 saved to a folder (the one tests/test_llamafactory.py writes), offline, fp32 on the
CPU. Losses are read from the ``trainer_log.jsonl`` LlamaFactory's logging callback writes. The
unpatched baseline is the same launcher and YAML without ``kernel_config``.

Runs in the LlamaFactory venv (``.ci/llamafactory``); skipped in the main venv.
"""

from __future__ import annotations

import gc
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from engine.errors import InvalidArgument, PatchsetError, SelfVerificationFailed, TrainerConflict, VerificationFailed

pytest.importorskip(
    "llamafactory.v1",
    reason="LlamaFactory is not installed here; .ci/llamafactory runs this file in its own venv "
    "(llamafactory==0.9.5 pins transformers<=5.6.0, trl<=0.24, peft<=0.18.1)",
)
from stack_helpers import (
    TRUST,
    LORA_DROPOUT,
    PATCHED_MODULES,
    STEPS,
    assert_one_line,
    assert_same_losses,
    launcher_output,
    write_distribution,
    write_tiny,
    wrong_norms,
)

from engine.integrations import llamafactory as lf


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = write_tiny(tmp_path_factory.mktemp("llamafactory_v1"))
    info = {"tiny_sft": {"path": str(root / "data" / "tiny_sft.json"), "source": "local", "converter": "alpaca"}}
    (root / "data" / "v1_dataset.yaml").write_text(yaml.safe_dump(info))
    return root


def write_config(tiny: Path, folder: Path, kernel_config: dict[str, Any] | None, *, lora: bool) -> Path:
    """A v1 SFT YAML for the tiny model, as a user writes one (plus ``kernel_config`` when given)."""
    config: dict[str, Any] = {
        "model": str(tiny / "model"), "template": "qwen3_nothink", "train_dataset": str(tiny / "data" / "v1_dataset.yaml"),
        "output_dir": str(folder / "out"), "micro_batch_size": 4, "global_batch_size": 4, "cutoff_len": 64,
        "learning_rate": 1e-2, "max_steps": STEPS, "bf16": False, "batching_workers": 0, "logging_steps": 1,
        "seed": 0,
    }
    if lora:
        config["peft_config"] = {"name": "lora", "r": 8, "target_modules": "all", "lora_dropout": LORA_DROPOUT}
    if kernel_config is not None:
        config["kernel_config"] = kernel_config
    path = folder / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def train(config: Path, *overrides: str) -> list[float]:
    """``python -m engine.integrations.llamafactory sft CONFIG`` (in process); the logged per-step losses."""
    lf.last_report = None
    lf.main(["sft", str(config), *overrides])
    gc.collect()  # a patched model holds its function router until collected (conftest explains)
    log = Path(yaml.safe_load(config.read_text())["output_dir"]) / "trainer_log.jsonl"
    return [json.loads(line)["loss"] for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture(scope="module")
def baseline(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    """Unpatched losses: the same launcher, the YAML without ``kernel_config``."""
    runs = {}
    for kind in ("full", "lora"):
        losses = train(write_config(tiny, tmp_path_factory.mktemp(f"v1_{kind}"), None, lora=kind == "lora"))
        assert len(losses) == STEPS and lf.last_report is None
        runs[kind] = losses
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_patched_sft_losses_equal_unpatched(tiny, tmp_path, baseline, kind) -> None:
    """Full: ``kernel_config: {name: patch_engine, verify: true}``, the patchset named after the model type.

    LoRA: ``patchset: qwen3`` named, verified, with dropout 0.05 (v1's default): the patched run
    must draw the same dropout masks, so its losses equal the unpatched ones bit for bit.
    """
    kernel_config = {"name": "patch_engine", "verify": True} if kind == "full" else {
        "name": "patch_engine", "patchset": "qwen3", "verify": True}
    from llamafactory.v1.utils.logging import get_logger

    get_logger()  # LlamaFactory's stdout handler, as every v1 module makes it on import
    with launcher_output("llamafactory.v1") as console:  # at its default level (no LLAMAFACTORY_VERBOSITY)
        losses = train(write_config(tiny, tmp_path, kernel_config, lora=kind == "lora"))
    report = lf.last_report
    assert report is not None and report.patchset == "qwen3" and len(report.patched) == PATCHED_MODULES, str(report)
    assert report.mode == "training" and report.verification.passed
    line = assert_one_line(console.getvalue(), verified=True)
    assert "] llamafactory.v1.plugins.patch_engine:" in line and ">> patch-engine: patchset 'qwen3'" in line, line
    assert_same_losses(losses, baseline[kind])


def test_a_wrong_declaration_is_refused_before_step_one(tiny, tmp_path) -> None:
    config = write_config(tiny, tmp_path, {"name": "patch_engine", "patchset": wrong_norms(tmp_path), "verify": True},
                          lora=False)
    with pytest.raises(VerificationFailed, match="Qwen3RMSNorm"):
        train(config)
    assert not (tmp_path / "out" / "trainer_log.jsonl").exists()  # no step was logged
    gc.collect()


@pytest.fixture
def no_model_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """A guard, not a stand-in: building a model at all fails the test."""
    from llamafactory.v1.core import model_engine

    def built(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("LlamaFactory built a model")

    monkeypatch.setattr(model_engine.ModelEngine, "__init__", built)


@pytest.mark.parametrize(("kernel_config", "error", "match"), [
    ({"name": "patch_engine", "patchset": "qwen3_typo"}, PatchsetError, "no patchset 'qwen3_typo'"),
    ({"name": "patch_engine", "patchsets": "qwen3"}, InvalidArgument, r"unknown key\(s\) \['patchsets'\]"),
    ({"name": "patch_engine", "verify": "yes"}, InvalidArgument, "verify is true or false"),
    ({"name": "patch_engine", "include_kernels": "rms_norm"}, InvalidArgument, "applied whole"),
    ({"name": "patch_engine", "fused_cross_entropy": True}, TrainerConflict, "outputs.logits"),
    ({"name": "patch_engine", "unverified_release": "sometimes"}, InvalidArgument,
     r"unverified_release='sometimes' is not a policy.*verify.*refuse.*trust"),
])
def test_bad_settings_stop_before_the_model_is_loaded(tiny, tmp_path, no_model_built, kernel_config, error, match):
    """Checked by the launcher when it reads the YAML: LlamaFactory builds nothing."""
    with pytest.raises(error, match=match):
        train(write_config(tiny, tmp_path, kernel_config, lora=False))


def test_settings_from_command_line_overrides(tiny, tmp_path, no_model_built) -> None:
    """``key=value`` overrides reach the plugin as v1 reads them (``kernel_config.patchset=...``)."""
    config = write_config(tiny, tmp_path, {"name": "patch_engine"}, lora=False)
    with pytest.raises(PatchsetError, match="no patchset 'qwen3_typo'"):
        train(config, "kernel_config.patchset=qwen3_typo")
    with pytest.raises(AssertionError, match="built a model"):  # accepted: LlamaFactory goes on to build it
        train(config, "kernel_config.patchset=llama", "kernel_config.verify=true")
    assert lf._settings.patchset.name == "llama" and lf._settings.verify is True


def test_llamafactory_alone_does_not_know_the_plugin(tiny, tmp_path, monkeypatch) -> None:
    """Why a launcher: v1 imports no user code, so without ours the name is LlamaFactory's own error."""
    from llamafactory.v1.plugins.model_plugins.kernels.interface import KernelPlugin

    monkeypatch.setitem(KernelPlugin._registry, "patch_engine", {})
    with pytest.raises(ValueError, match="Method __call__ of plugin patch_engine is not registered"):
        KernelPlugin("patch_engine")(model=None, include_kernels=None)


@pytest.mark.slow
def test_a_wrong_declaration_shows_in_the_losses(tiny, tmp_path, baseline, monkeypatch) -> None:
    """The equality above can fail: by default the flipped ``scale`` (a file of the user's own) is verified first and
    refused before step 1; applied unverified (``unverified: trust``) it trains with other losses from step 1."""
    config = write_config(tiny, tmp_path, {"name": "patch_engine", "patchset": wrong_norms(tmp_path)}, lora=False)
    with pytest.raises(SelfVerificationFailed, match="Qwen3RMSNorm"):
        train(config, "max_steps=1")
    assert not (tmp_path / "out" / "trainer_log.jsonl").exists()  # no step was logged
    for name, value in TRUST.items():
        monkeypatch.setenv(name, value)
    losses = train(config, "max_steps=1")  # the first step's loss already differs
    assert len(lf.last_report.patched) == PATCHED_MODULES
    assert abs(losses[0] - baseline["full"][0]) > 1e-2, f"wrong scale {losses} vs unpatched {baseline['full']}"


def test_a_broken_dependency_is_named_not_llamafactory(tmp_path) -> None:
    """LlamaFactory installed, torchvision broken (a CUDA build beside the CPU torch): the launcher names torchvision.

    Before: ``MissingDependency: the LlamaFactory v1 integration needs LlamaFactory 0.9.5 or later (its v1 API)
    (llamafactory.v1.config.arg_parser): pip install "llamafactory==0.9.5" (ModuleNotFoundError: Could not import
    module 'set_seed'. ...)``, with 0.9.5 installed. The stand-in torchvision registers a fake for an op its
    native library would have defined (what the real one's ``_meta_registrations`` does): torch raises, as it
    did for the CUDA build, and transformers' lazy import turns that into ``Could not import module 'set_seed'``.
    """
    import os
    import subprocess
    import sys

    from conftest import ROOT

    site = write_distribution(tmp_path / "site", "torchvision", "0.28.0", {
        "torchvision/__init__.py": "from . import _meta_registrations\n",
        "torchvision/_meta_registrations.py": ("import torch\n\n\n@torch.library.register_fake('torchvision::nms')\n"
                                               "def meta_nms(dets, scores, iou_threshold):\n    return dets\n"),
    })
    config = tmp_path / "cfg.yaml"
    config.write_text("model: /nonexistent\nkernel_config: {name: patch_engine}\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)]), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "engine.integrations.llamafactory", "sft", str(config)],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300, check=False)
    assert proc.returncode != 0
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("MissingDependency: the LlamaFactory v1 integration: importing llamafactory.v1."), error
    assert ("failed in torchvision._meta_registrations (torchvision 0.28.0): RuntimeError: operator "
            "torchvision::nms does not exist") in error, error
    assert "Could not import module 'set_seed'" in error and "llamafactory 0.9.5 is installed" in error, error
    assert "pip install" not in error, error


def test_several_processes_start_torchrun_on_this_launcher(monkeypatch) -> None:
    """Where LlamaFactory's ``launch()`` would start ``torchrun`` on its own script, ours starts it on this module."""
    monkeypatch.setenv("FORCE_TORCHRUN", "1")
    monkeypatch.setenv("NPROC_PER_NODE", "2")
    monkeypatch.setenv("MASTER_PORT", "29555")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    command = lf._torchrun_args("sft", ["cfg.yaml", "learning_rate=1e-5"])
    assert command[:3] == ["torchrun", "--nproc-per-node", "2"]
    assert command[-5:] == ["-m", "engine.integrations.llamafactory", "sft", "cfg.yaml", "learning_rate=1e-5"]
    assert "29555" in command
    monkeypatch.setenv("LOCAL_RANK", "0")  # inside a torchrun worker: train here
    assert lf._torchrun_args("sft", ["cfg.yaml"]) is None


def test_run_from_python_checks_the_same_settings(tiny, tmp_path, no_model_built) -> None:
    """``run("sft", config_dict)``: the same checks as the launcher, before LlamaFactory builds anything."""
    config = yaml.safe_load(write_config(tiny, tmp_path, {"name": "patch_engine", "patchset": "qwen3_typo"},
                                         lora=False).read_text())
    with pytest.raises(PatchsetError, match="no patchset 'qwen3_typo'"):
        lf.run("sft", config)
    with pytest.raises(InvalidArgument, match="one of 'sft', 'train', 'rm'"):
        lf.run("chat", config)
