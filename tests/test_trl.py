"""TRL's ``SFTTrainer`` with the real ``trl`` package: patched layers train like unpatched ones, and the fused
head is refused, saying what TRL does instead, rather than bypassed in silence (trl >= 1.16) or crashing
inside TRL at step 1 (trl 0.29).

The same file runs in the main suite (the newest trl 1.x) and in ``.ci/trl029.sh`` (trl 0.29.1, in its own
venv); where the versions differ, it asserts what the installed version does.
"""

from __future__ import annotations

import warnings

import pytest
import torch

trl = pytest.importorskip("trl", reason="the trl extra is not installed")
datasets = pytest.importorskip("datasets")

from conftest import tiny_for
from packaging.version import Version
from training_helpers import extra_kernel, qwen3_patchset
from trl.trainer import utils as trl_utils

import engine
from engine.integrations.transformers import PatchsetCallback
from engine.ops.rope import rope_reference

TOL = 1e-5
STEPS = 4
#: trl >= 1.16 replaces the model's forward with its own fused LM head; 0.29 reads outputs.logits.
TRL_OWN_HEAD = hasattr(trl_utils, "add_fused_lm_head")


def test_the_installed_trl_is_one_this_file_knows() -> None:
    version = Version(trl.__version__)
    assert TRL_OWN_HEAD == (version >= Version("1.16")), trl.__version__
    assert version >= Version("0.29"), "the trl extra asks for >= 0.29"


def _tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(254)} | {"<pad>": 254, "<eos>": 255}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                   pad_token="<pad>", eos_token="<eos>")


def _dataset(n: int = 16):
    """Pre-tokenized prompt + completion rows of different lengths (``completion_mask`` marks the completion)."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        prompt, completion = (torch.randint(0, 254, (int(torch.randint(3, 9, (1,), generator=gen)),),
                                            generator=gen).tolist() for _ in range(2))
        rows.append({"input_ids": prompt + completion, "completion_mask": [0] * len(prompt) + [1] * len(completion)})
    return datasets.Dataset.from_list(rows)


#: The SFT modes the layer patches are checked in: packing (whole sequences), completion-only loss, LoRA.
MODES = {
    "packing": {"packing": True, "max_length": 32, "completion_only_loss": False},
    "completion_only": {"completion_only_loss": True},
    "lora": {"completion_only_loss": True},
}


def _trainer(model, tmp_path, mode: str, callbacks=None):
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=1e-3,
                     logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
                     dataloader_num_workers=0, **MODES[mode])
    peft_config = None
    if mode == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                 target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"])
    return SFTTrainer(model=model, args=args, train_dataset=_dataset(), processing_class=_tokenizer(),
                      callbacks=callbacks, peft_config=peft_config)


def _losses(trainer) -> list[float]:
    trainer.train()
    losses = [row["loss"] for row in trainer.state.log_history if "loss" in row]
    assert len(losses) == STEPS
    return losses


@pytest.mark.parametrize("mode,how", [("packing", "apply"), ("completion_only", "callback"), ("lora", "callback")])
def test_sft_with_the_layer_patches_trains_like_without(mode: str, how: str, tmp_path, capsys) -> None:
    """Norm, MLP and rope patches under SFTTrainer: the logged losses of the unpatched run, and the kernels ran."""
    reference = _losses(_trainer(tiny_for("qwen3"), tmp_path / "ref", mode))
    calls: list[int] = []

    def counting(q, k, cos, sin, unsqueeze_dim=1):
        calls.append(1)
        return rope_reference(q, k, cos, sin, unsqueeze_dim)

    model = tiny_for("qwen3")
    ps = qwen3_patchset(rope="trl_counting")
    with extra_kernel("trl_counting", "rope", counting):
        try:
            if how == "apply":
                engine.apply(model, ps, device="cpu", mode="training")
                trainer = _trainer(model, tmp_path / "patched", mode)
            else:
                callback = PatchsetCallback(ps)
                trainer = _trainer(model, tmp_path / "patched", mode, callbacks=[callback])
                assert callback.report is not None and callback.report.mode == "training"
            assert engine.is_patched(model)
            losses = _losses(trainer)
        finally:
            engine.revert(model)
    assert len(calls) >= STEPS * 2  # each step's forward ran the patched rope in both attention layers
    assert max(abs(a - b) for a, b in zip(losses, reference)) <= TOL, (losses, reference)
    assert len(set(reference)) > 1  # the run trained
    if how == "callback":  # TRL's default output (its printed logs) shows the callback's one line, once
        out = capsys.readouterr().out
        assert [line for line in out.splitlines() if line.startswith("patch-engine: patchset 'qwen3' on qwen3 "
                                                                     "(cpu, training): 12 patched, 0 skipped")], out
        assert sum(line.startswith("patch-engine: ") for line in out.splitlines()) == 1, out


def _expected_refusal() -> str:
    return "its own fused LM head" if TRL_OWN_HEAD else "reads outputs.logits"


def test_fused_head_with_the_callback_is_refused_before_anything_is_patched(tmp_path) -> None:
    model = tiny_for("qwen3")
    with pytest.raises(engine.TrainerConflict, match=_expected_refusal()) as info:
        _trainer(model, tmp_path, "completion_only", callbacks=[PatchsetCallback(qwen3_patchset(), fused_cross_entropy=True)])
    assert "fused_cross_entropy" in str(info.value) and f"trl {trl.__version__}" in str(info.value)
    assert not engine.is_patched(model)
    assert "forward" not in model.model.norm.__dict__


@pytest.mark.parametrize("mode", ["completion_only", "lora"])
def test_fused_head_applied_before_the_trainer_is_refused_at_the_first_step(mode: str, tmp_path) -> None:
    """Refused before the first forward computes anything: no optimizer step, and not an error inside TRL."""
    model = tiny_for("qwen3")
    engine.apply(model, qwen3_patchset(), device="cpu", mode="training", fused_cross_entropy=True)
    try:
        trainer = _trainer(model, tmp_path, mode)
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with pytest.raises(engine.TrainerConflict, match=_expected_refusal()) as info:
            trainer.train()
        assert isinstance(info.value, ValueError)  # as TRL's own refusals
        assert info.traceback[-1].path.name == "trl_head.py"  # raised by the engine, not deep inside TRL
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    finally:
        with warnings.catch_warnings():  # trl >= 1.16 wrapped the root forward: revert says it stays beneath
            warnings.simplefilter("ignore", RuntimeWarning)
            engine.revert(model)


@pytest.mark.skipif(not TRL_OWN_HEAD, reason="trl < 1.16 does not replace the model's forward")
def test_fused_head_planned_after_trl_replaced_the_forward_is_refused_at_plan_time(tmp_path) -> None:
    model = tiny_for("qwen3")
    _trainer(model, tmp_path, "completion_only", callbacks=[PatchsetCallback(qwen3_patchset())])
    report = engine.apply(model, qwen3_patchset())  # the layer patches, re-applied: a no-op
    with pytest.raises(engine.TrainerConflict, match="add_fused_lm_head"):
        engine.plan(model, qwen3_patchset(), device="cpu", mode="training", fused_cross_entropy=True)
    with pytest.raises(engine.TrainerConflict):
        engine.apply(model, qwen3_patchset(), device="cpu", mode="training", fused_cross_entropy=True)
    assert engine.apply(model, qwen3_patchset()) is report  # unchanged by the refused apply
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        engine.revert(model)
