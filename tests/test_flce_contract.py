"""The fused head keeps transformers' model contract (issue 13): numbers against the unpatched model.

* the forward's signature: a real ``Trainer`` with ``remove_unused_columns`` trains the
  patched model with the unpatched losses (a ``*args, **kwargs`` forward loses input_ids);
* ``generate``: prefill logits for the last position only (the lm_head output sizes seen
  during generate are the unpatched ones), the same tokens;
* PEFT LoRA on ``lm_head``, in both orders: the unpatched loss and adapter gradients, or a
  clear refusal (dropout on the adapter) at plan time / at the call;
* ``logits_to_keep`` with labels, ``shift_labels`` without labels, ``return_dict=False``,
  ``ignore_index``, ``num_items_in_batch``, eval mode: the unpatched outputs or errors.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_for
from peft import LoraConfig, get_peft_model
from transformers import Trainer, TrainingArguments

import engine
from engine.errors import SignatureMismatch
from engine.patching.patcher import is_patched
from engine.verification import probe_batch


def _pair(name: str = "qwen3", **overrides):
    reference = tiny_for(name, **overrides)
    reference.train()
    patched = copy.deepcopy(reference)
    engine.apply(patched, name, device="cpu", fused_cross_entropy={"chunk_size": 5})
    return reference, patched


def _batch(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    batch = probe_batch(model, seq=16)
    batch["labels"][1, 10:] = -100
    return batch


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


# -- Trainer ---------------------------------------------------------------------------------


def test_trainer_remove_unused_columns_keeps_input_ids(tmp_path) -> None:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(16):
        ids = torch.randint(0, 256, (12,), generator=gen)
        rows.append({"input_ids": ids, "labels": ids.clone(), "source_id": torch.tensor(i)})  # a column to drop
    losses = []
    for fused in (False, True):
        model = tiny_for("qwen3")
        if fused:
            engine.apply(model, "qwen3", device="cpu", mode="training", fused_cross_entropy=True)
        args = TrainingArguments(
            output_dir=str(tmp_path / str(fused)), max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3,
            logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
            remove_unused_columns=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=rows)
        trainer.train()
        losses.append([r["loss"] for r in trainer.state.log_history if "loss" in r])
    assert len(losses[0]) == 4
    assert losses[1] == pytest.approx(losses[0], abs=1e-5)


# -- generate --------------------------------------------------------------------------------


def test_generate_computes_last_position_logits_only() -> None:
    reference, patched = _pair()
    prompt = _batch(reference)["input_ids"][:1, :9]
    sizes: dict[str, list[tuple[int, ...]]] = {}
    outputs = {}
    for label, model in (("reference", reference), ("patched", patched)):
        model.eval()
        seen: list[tuple[int, ...]] = []
        handle = model.lm_head.register_forward_hook(lambda m, i, o, seen=seen: seen.append(tuple(o.shape)))
        outputs[label] = model.generate(prompt, max_new_tokens=4, do_sample=False)
        handle.remove()
        sizes[label] = seen
    assert sizes["patched"] == sizes["reference"] and sizes["reference"][0] == (1, 1, 256)
    assert torch.equal(outputs["patched"], outputs["reference"])


def test_eval_and_no_labels_return_the_unpatched_logits() -> None:
    reference, patched = _pair()
    batch = _batch(reference)
    with torch.no_grad():
        assert torch.equal(patched(input_ids=batch["input_ids"]).logits, reference(input_ids=batch["input_ids"]).logits)
        reference.eval(), patched.eval()
        got, want = patched(**batch), reference(**batch)
    assert torch.equal(got.logits, want.logits) and torch.equal(got.loss, want.loss)


# -- arguments -------------------------------------------------------------------------------


def test_logits_to_keep_with_labels_gives_the_unpatched_outputs_or_errors() -> None:
    reference, patched = _pair()
    batch = _batch(reference)
    with pytest.raises(ValueError) as want:  # labels for 16 positions, logits for 4
        reference(**batch, logits_to_keep=4)
    with pytest.raises(type(want.value)) as got:
        patched(**batch, logits_to_keep=4)
    assert str(got.value) == str(want.value)
    short = {"input_ids": batch["input_ids"], "labels": batch["labels"][:, -4:]}
    ref, pat = reference(**short, logits_to_keep=4), patched(**short, logits_to_keep=4)
    assert torch.equal(pat.logits, ref.logits) and torch.equal(pat.loss, ref.loss)


def test_shift_labels_without_labels_computes_no_loss() -> None:
    reference, patched = _pair()
    batch = _batch(reference)
    shift = F.pad(batch["labels"], (0, 1), value=-100)[..., 1:]
    ref = reference(input_ids=batch["input_ids"], shift_labels=shift)
    pat = patched(input_ids=batch["input_ids"], shift_labels=shift)
    assert ref.loss is None and pat.loss is None and torch.equal(pat.logits, ref.logits)


def test_shift_labels_with_labels_are_used_as_given() -> None:
    reference, patched = _pair()
    batch = _batch(reference)
    shift = torch.roll(batch["labels"], 3, dims=1)  # not the labels shifted: shift_labels must win
    ref = reference(**batch, shift_labels=shift)
    pat = patched(**batch, shift_labels=shift)
    assert abs(pat.loss.item() - ref.loss.item()) <= 1e-5


def test_return_dict_false_keeps_the_tuple_positions() -> None:
    reference, patched = _pair("qwen3_moe")
    batch = _batch(reference)
    want = reference(**batch, return_dict=False, output_router_logits=True)
    got = patched(**batch, return_dict=False, output_router_logits=True)
    assert isinstance(got, tuple) and len(got) == len(want)
    assert abs(got[0].item() - want[0].item()) <= 1e-5  # loss, incl. the router loss
    assert torch.equal(got[1], want[1])  # aux_loss
    assert got[2] is None and want[2].shape[-1] == 256  # logits: not materialized, position kept


@pytest.mark.parametrize("ignore_index", [-100, 7])
@pytest.mark.parametrize("num_items", [None, 19, "tensor"])
def test_ignore_index_and_num_items_in_batch(ignore_index: int, num_items) -> None:
    reference, patched = _pair()
    batch = _batch(reference)
    batch["labels"][0, :4] = -100
    batch["labels"][batch["labels"] == -100] = ignore_index
    extra = {"ignore_index": ignore_index}
    if num_items is not None:
        extra["num_items_in_batch"] = torch.tensor(23) if num_items == "tensor" else num_items
    results = []
    for model in (reference, patched):
        model.zero_grad(set_to_none=True)
        out = model(**batch, **extra)
        (2.5 * out.loss).backward()  # a loss scale: grad_output != 1
        results.append((out.loss.detach(), _grads(model)))
    (ref_loss, ref_grads), (pat_loss, pat_grads) = results
    assert abs(pat_loss.item() - ref_loss.item()) <= 1e-5
    for k in ref_grads:
        assert torch.allclose(pat_grads[k], ref_grads[k], atol=1e-5, rtol=0), k


def test_signature_error_for_a_bad_argument_is_the_unpatched_one() -> None:
    reference, patched = _pair()
    with pytest.raises(TypeError) as want:
        reference(torch.zeros(1, 2, dtype=torch.long), None, None, None, None, None, None, 0, "extra")
    with pytest.raises(TypeError) as got:
        patched(torch.zeros(1, 2, dtype=torch.long), None, None, None, None, None, None, 0, "extra")
    assert type(got.value) is type(want.value) and str(got.value) == str(want.value)


# -- PEFT LoRA on lm_head ----------------------------------------------------------------------


def _lora(model: torch.nn.Module, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(7)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, init_lora_weights=False,
                                            target_modules=["lm_head", "q_proj"], task_type="CAUSAL_LM"))


@pytest.mark.parametrize("order", ["lora_then_apply", "apply_then_lora"])
def test_lora_on_lm_head_trains_the_adapter_with_the_unpatched_loss(order: str) -> None:
    base = tiny_for("qwen3")
    reference = _lora(copy.deepcopy(base))
    if order == "lora_then_apply":
        patched = _lora(copy.deepcopy(base))
        engine.apply(patched, "qwen3", device="cpu", mode="training", fused_cross_entropy=True)
    else:
        inner = copy.deepcopy(base)
        engine.apply(inner, "qwen3", device="cpu", mode="training", fused_cross_entropy=True)
        patched = _lora(inner)
    batch = _batch(base)
    results = []
    for model in (reference, patched):
        model.train()
        out = model(**batch)
        out.loss.backward()
        results.append((out, _grads(model)))
    (ref, ref_grads), (pat, pat_grads) = results
    assert pat.logits is None
    assert abs(pat.loss.item() - ref.loss.item()) <= 1e-5
    head_grads = [k for k in ref_grads if "lm_head.lora_" in k]
    assert len(head_grads) == 2 and pat_grads.keys() == ref_grads.keys()
    for k in ref_grads:
        assert ref_grads[k].abs().max() > 0, k
        assert torch.allclose(pat_grads[k], ref_grads[k], atol=1e-5, rtol=0), k


def test_lora_with_dropout_on_lm_head_is_refused_in_both_orders() -> None:
    base = tiny_for("qwen3")
    wrapped = _lora(copy.deepcopy(base), dropout=0.1)
    with pytest.raises(SignatureMismatch, match="lora_dropout"):
        engine.apply(wrapped, "qwen3", device="cpu", mode="training", fused_cross_entropy=True)
    assert not is_patched(wrapped)
    inner = copy.deepcopy(base)
    engine.apply(inner, "qwen3", device="cpu", mode="training", fused_cross_entropy=True)
    late = _lora(inner, dropout=0.1)
    late.train()
    with pytest.raises(SignatureMismatch, match="lora_dropout"):
        late(**_batch(base))


def test_pickled_model_keeps_the_fused_head() -> None:
    import inspect
    import pickle

    reference, patched = _pair()
    batch = _batch(reference)
    loaded = pickle.loads(pickle.dumps(patched))
    out = loaded(**batch)
    assert out.logits is None and engine.is_patched(loaded)
    assert abs(out.loss.item() - reference(**batch).loss.item()) <= 1e-5
    assert inspect.signature(loaded.forward) == inspect.signature(reference.forward)
