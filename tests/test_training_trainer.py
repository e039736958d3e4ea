"""Hugging Face Trainer with one added line: a patched run logs the same losses as an unpatched one."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import tiny_for
from training_helpers import extra_kernel, qwen3_patchset
from transformers import Trainer, TrainingArguments

import engine
from engine.integrations.transformers import PatchsetCallback, patch_for_training
from engine.ops.rope import rope_reference

TOL = 1e-5
STEPS = 6


def _dataset(n: int = 24, seq: int = 16) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(0, 256, (seq,), generator=gen)
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


def _args(tmp_path) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-3,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
        dataloader_num_workers=0,
    )


def _losses(trainer: Trainer) -> list[float]:
    trainer.train()
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[float]:
    """The unpatched run's logged losses (shared by both ways of patching)."""
    losses = _losses(Trainer(model=tiny_for("qwen3"), args=_args(tmp_path_factory.mktemp("ref")),
                             train_dataset=_dataset()))
    assert len(losses) == STEPS
    return losses


@pytest.mark.parametrize("how", ["callback", "helper"])
def test_trainer_with_a_patchset_trains_like_without(how: str, reference: list[float], tmp_path, capsys) -> None:
    calls: list[int] = []

    def counting(q, k, cos, sin, unsqueeze_dim=1):
        calls.append(1)
        return rope_reference(q, k, cos, sin, unsqueeze_dim)

    data = _dataset()
    model = tiny_for("qwen3")
    model.eval()  # as from_pretrained returns it: the plan must still be for training
    ps = qwen3_patchset(rope="trainer_counting")
    with extra_kernel("trainer_counting", "rope", counting):
        if how == "callback":
            callback = PatchsetCallback(ps)
            trainer = Trainer(model=model, args=_args(tmp_path / "cb"), train_dataset=data, callbacks=[callback])
            assert engine.is_patched(model) and callback.report.mode == "training"  # applied in __init__
        else:
            trainer = Trainer(model=patch_for_training(model, ps, device="cpu"), args=_args(tmp_path / "h"),
                              train_dataset=data)
        calls.clear()  # the content is the test's own, so apply verified it first on a tiny model, calling the kernel
        try:
            losses = _losses(trainer)
        finally:
            engine.revert(model)
    assert len(calls) == STEPS * 2  # each step's forward, in both attention layers
    assert max(abs(a - b) for a, b in zip(losses, reference)) <= TOL, (losses, reference)
    if how == "callback":  # what the Trainer prints (its loss dicts, disable_tqdm=True) and, once, the one line
        out = capsys.readouterr().out
        lines = [line for line in out.splitlines() if line.startswith("patch-engine: ")]
        # the content is the test's own (a dict), so apply verified it first on a tiny qwen3 (or read its verdict)
        assert len(lines) == 1, out
        assert lines[0].startswith("patch-engine: patchset 'qwen3' on qwen3 (cpu, training): 12 patched, 0 skipped; "
                                   "kernels rms_norm: torch x9, swiglu: torch x2, rope: trainer_counting x1; verified "
                                   "first on a tiny qwen3 (Qwen3ForCausalLM): passed ("), out
        assert lines[0].endswith("why: patchset 'qwen3', a patchset of your own, built in memory (a dict or a "
                                 "Patchset), is not content CI verified on transformers " + transformers.__version__), out
        assert "{'loss':" in out and "patch-engine report:" not in out, out


def test_callback_can_revert_when_training_ends(tmp_path) -> None:
    model = tiny_for("qwen3")
    callback = PatchsetCallback(qwen3_patchset(), revert_on_end=True)
    trainer = Trainer(model=model, args=_args(tmp_path), train_dataset=_dataset(8), callbacks=[callback])
    assert engine.is_patched(model)
    trainer.train()
    assert not engine.is_patched(model)
    assert "forward" not in model.model.norm.__dict__


def test_only_the_main_process_shows_the_line(monkeypatch) -> None:
    """Every rank patches its own model; only rank 0 says so (``$RANK`` as torchrun sets it, no process group here)."""
    from engine.integrations.announce import announce
    from engine.planning.report import Report

    report = Report.from_plan(engine.plan(tiny_for("qwen3"), qwen3_patchset(), device="cpu", mode="training"))
    for rank, expected in (("1", []), ("0", [report.summary_line()])):
        monkeypatch.setenv("RANK", rank)
        shown: list[str] = []
        announce(report, line=shown.append, detail=lambda text: None)
        assert shown == expected, rank
