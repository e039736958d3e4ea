"""axolotl's own training with a patchset: ``plugins: [engine.integrations.axolotl.PatchsetPlugin]``.

The recipe of docs/training.md, "axolotl", run for real in-process through axolotl's Python
entry points (``axolotl.cli.config.load_cfg``, ``axolotl.common.datasets.load_datasets``,
``axolotl.train.train``: what ``axolotl train config.yaml`` runs) on a YAML a user would write:
axolotl's plugin loading and config validation (our keys included), its alpaca loader, model
loader and LoRA wrapping, its trainer, on a tiny perturbed Qwen3 saved to a folder, offline,
fp32 on the CPU. The unpatched baseline is the same YAML without the plugin and our keys.

axolotl 0.21 brings transformers 5.20.1 and HF ``kernels`` and declares Python >= 3.12, so it
lives in its own venv: ``.ci/axolotl`` builds it and runs this file. In the main venv only the
test of the missing-package error runs.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
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

from engine.errors import MissingDependency, ModelTypeMismatch, SelfVerificationFailed, VerificationFailed

HAS_AXOLOTL = installed("axolotl")
needs_axolotl = pytest.mark.skipif(
    not HAS_AXOLOTL, reason="axolotl is not installed here; .ci/axolotl runs this file in its own venv "
    "(axolotl==0.21.0 brings transformers 5.20.1 and kernels)")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model and tokenizer are local folders
os.environ.setdefault("AXOLOTL_DO_NOT_TRACK", "1")  # axolotl's telemetry: no network here
PLUGIN = "engine.integrations.axolotl.PatchsetPlugin"


@pytest.mark.skipif(HAS_AXOLOTL, reason="axolotl is installed: the missing-package error cannot be seen here")
def test_without_axolotl_the_plugin_names_what_to_install() -> None:
    with pytest.raises(MissingDependency, match=r"needs axolotl \(axolotl\.integrations\.base\): pip install axolotl"):
        import engine.integrations.axolotl  # noqa: F401


# --- the real axolotl --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny(tmp_path_factory.mktemp("axolotl"))


def config(tiny: Path, out: Path, adapter: str | None, steps: int = STEPS, **ours: Any) -> Path:
    """The YAML a user writes (axolotl's keys), plus ``ours`` (the plugin line and its keys) when given."""
    # sequence_len 256: alpaca's preamble is ~150 tokens of the byte-level tokenizer
    cfg: dict[str, Any] = {
        "base_model": str(tiny / "model"), "tokenizer_type": "AutoTokenizer",
        "datasets": [{"path": str(tiny / "data" / "tiny_sft.json"), "type": "alpaca", "ds_type": "json"}],
        "dataset_prepared_path": str(out / "prepared"), "val_set_size": 0, "sequence_len": 256,
        "sample_packing": False, "micro_batch_size": 4, "gradient_accumulation_steps": 1, "num_epochs": 1,
        "max_steps": steps, "learning_rate": 0.01, "lr_scheduler": "constant", "optimizer": "adamw_torch",
        "warmup_steps": 0, "logging_steps": 1, "save_strategy": "no", "output_dir": str(out / "out"),
        "bf16": False, "fp16": False, "tf32": False, "seed": 0, "dataloader_num_workers": 0, "dataset_num_proc": 1,
    }
    if adapter == "lora":
        cfg.update(adapter="lora", lora_r=8, lora_alpha=16, lora_dropout=LORA_DROPOUT, lora_target_linear=True,
                   # axolotl turns its Triton LoRA kernels on by default; they need CUDA
                   lora_mlp_kernel=False, lora_qkv_kernel=False, lora_o_kernel=False)
    if ours:
        cfg.update(plugins=[PLUGIN], **ours)
    path = out / "config.yaml"
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


def _fresh_plugins() -> None:
    """axolotl keeps its plugins in a process-wide ``PluginManager``: start each run without ours."""
    from axolotl.integrations.base import PluginManager

    PluginManager._instance = None


def axolotl_train(path: Path) -> tuple[list[float], Any, str]:
    """axolotl's train on ``path``; (per-step losses, our plugin or ``None``, what axolotl's console showed).

    The console is axolotl's own handler, configured as ``axolotl train`` configures it (importing
    ``axolotl.cli`` runs its ``configure_logging``) and read at its default levels (no ``LOG_LEVEL``).
    """
    from axolotl.cli.config import load_cfg
    from axolotl.common.datasets import load_datasets
    from axolotl.integrations.base import PluginManager
    from axolotl.train import train

    _fresh_plugins()
    try:
        with launcher_output("axolotl", exclude=("ax_file_only",)) as console:
            cfg = load_cfg(str(path))
            dataset_meta = load_datasets(cfg=cfg)
            _, _, trainer = train(cfg=cfg, dataset_meta=dataset_meta)
        losses = [float(h["loss"]) for h in trainer.state.log_history if "loss" in h]
        ours = PluginManager.get_instance().plugins.get(PLUGIN)
        return losses, ours, console.getvalue()
    finally:
        gc.collect()  # a patched model holds its function router until collected (conftest explains)


@pytest.fixture(scope="module")
def baseline(tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[float]]:
    runs = {}
    for adapter in ("full", "lora"):
        losses, ours, console = axolotl_train(config(tiny, tmp_path_factory.mktemp("baseline"), adapter))
        assert ours is None and len(losses) == STEPS and "patch-engine" not in console
        runs[adapter] = losses
    return runs


@needs_axolotl
@pytest.mark.slow
@pytest.mark.parametrize(("adapter", "ours"), [
    ("full", {"patchset": "qwen3", "patchset_verify": True}),
    ("lora", {"patchset_verify": True}),  # no `patchset:` key: zero configuration, the bundled qwen3
])
def test_patched_losses_equal_unpatched(tiny, tmp_path, baseline, adapter, ours) -> None:
    losses, plugin, console = axolotl_train(config(tiny, tmp_path, adapter, **ours))
    assert plugin.report.patchset == "qwen3" and len(plugin.report.patched) == PATCHED_MODULES, str(plugin.report)
    assert plugin.report.verification.passed and plugin.report.mode == "training"
    line = assert_one_line(console, verified=True)  # at axolotl's default level, through its handler
    assert "[INFO] [axolotl.integrations.patch_engine] patch-engine: patchset 'qwen3' on qwen3" in line, line
    assert_same_losses(losses, baseline[adapter])  # LoRA: dropout 0.05 and verification, bit for bit


@needs_axolotl
@pytest.mark.slow
def test_the_fused_head_trains_like_the_unpatched_head(tiny, tmp_path, baseline) -> None:
    """``patchset_fused_cross_entropy: true``: head + loss fused (chunked), the losses as unpatched to rounding."""
    losses, plugin, _ = axolotl_train(config(tiny, tmp_path, "full", patchset="qwen3", patchset_fused_cross_entropy=True))
    assert any(d.op == "fused_linear_cross_entropy" and d.action == "patch" for d in plugin.report.decisions), str(
        plugin.report)
    diffs = [abs(a - b) for a, b in zip(losses, baseline["full"], strict=True)]
    assert max(diffs) <= 1e-4, f"fused head {losses} vs unpatched {baseline['full']}"


@needs_axolotl
def test_a_fused_head_under_rl_is_refused_before_patching(tiny) -> None:
    """``rl:`` trains with TRL's trainers, which compute the head themselves: refused, the model untouched."""
    from axolotl.utils.dict import DictDefault
    from transformers import AutoModelForCausalLM

    from engine import is_patched
    from engine.errors import TrainerConflict
    from engine.integrations.axolotl import PatchsetPlugin

    model = AutoModelForCausalLM.from_pretrained(tiny / "model")
    cfg = DictDefault(rl="dpo", patchset="qwen3", patchset_fused_cross_entropy=True)
    with pytest.raises(TrainerConflict, match="rl: dpo"):
        PatchsetPlugin().post_model_load(cfg, model)
    assert not is_patched(model)


@needs_axolotl
@pytest.mark.slow
def test_a_wrong_declaration_shows_in_the_losses(tiny, tmp_path, baseline, monkeypatch) -> None:
    """The comparison above can fail. No ``patchset_verify``: by default a file of the user's own is verified first
    and refused before step 1; applied unverified (``unverified: trust``) the loss of step 1 already differs."""
    with pytest.raises(SelfVerificationFailed, match="Qwen3RMSNorm"):
        axolotl_train(config(tiny, tmp_path / "default", "full", steps=1, patchset=wrong_norms(tmp_path)))
    for name, value in TRUST.items():
        monkeypatch.setenv(name, value)
    losses, ours, console = axolotl_train(config(tiny, tmp_path, "full", steps=1, patchset=wrong_norms(tmp_path)))
    assert len(ours.report.patched) == PATCHED_MODULES
    assert_one_line(console, verified=False)  # "not verified (turn verification on ...)"
    assert abs(losses[0] - baseline["full"][0]) > 1e-2, f"wrong norms {losses} vs unpatched {baseline['full']}"


@needs_axolotl
def test_verify_stops_a_wrong_declaration_before_step_one(tiny, tmp_path) -> None:
    path = config(tiny, tmp_path, "full", patchset=wrong_norms(tmp_path), patchset_verify=True)
    with pytest.raises(VerificationFailed, match="Qwen3RMSNorm"):
        axolotl_train(path)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("checkpoint-*"))


@needs_axolotl
def test_a_patchset_for_another_family_stops_before_the_trainer(tiny, tmp_path) -> None:
    """``patchset: llama`` on a Qwen3 checkpoint: refused when the model is loaded, before the trainer."""
    with pytest.raises(ModelTypeMismatch, match="qwen3"):
        axolotl_train(config(tiny, tmp_path, "full", patchset="llama"))


@needs_axolotl
def test_the_plugin_keeps_axolotl_from_auto_enabling_its_lora_mlp_kernel(tiny, tmp_path) -> None:
    """axolotl turns its Triton LoRA kernels on for a LoRA config that sets none; the MLP one would be refused."""
    from axolotl.cli.config import load_cfg

    plain = yaml.safe_load(config(tiny, tmp_path / "a", "lora").read_text())
    for flag in ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel"):
        del plain[flag]
    (tmp_path / "plain.yaml").write_text(yaml.safe_dump(plain))
    (tmp_path / "ours.yaml").write_text(yaml.safe_dump({**plain, "plugins": [PLUGIN], "patchset": "qwen3"}))
    _fresh_plugins()
    assert load_cfg(str(tmp_path / "plain.yaml")).lora_mlp_kernel is True  # what it would do without us
    _fresh_plugins()
    assert load_cfg(str(tmp_path / "ours.yaml")).lora_mlp_kernel is False


@needs_axolotl
@pytest.mark.parametrize(("ours", "message"), [
    # the plugin's keys only (before: axolotl's ~400, the schema the plugin's model is merged into)
    ({"patchset_verfy": True}, (r"unknown key 'patchset_verfy' for engine\.integrations\.axolotl\.PatchsetPlugin \(its "
                                r"keys: patchset, patchset_fused_cross_entropy, patchset_unverified, patchset_unverified_release, "
                                r"patchset_verify\); did you mean 'patchset_verify'\?")),
    ({"patchset": "qwen3_typo"}, r"no patchset 'qwen3_typo'"),
    ({"patchset": "qwen3", "patchset_verify": "often"}, r"patchset_verify"),
    ({"patchset": "qwen3", "patchset_fused_cross_entropy": {"kernel": "auto", "chunk": 8}}, r"chunk"),
    ({"patchset": "qwen3", "patchset_unverified_release": "sometimes"}, r"patchset_unverified_release"),
])
def test_axolotl_validation_refuses_bad_keys_before_loading_the_model(tiny, tmp_path, ours, message) -> None:
    from axolotl.cli.config import load_cfg

    _fresh_plugins()
    with pytest.raises(ValueError, match=message):
        load_cfg(str(config(tiny, tmp_path, "full", **ours)))
