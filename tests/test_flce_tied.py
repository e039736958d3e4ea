"""Tied head + embedding under the fused head: one ``[vocab, hidden]`` gradient, the unpatched numbers.

With ``tie_word_embeddings`` the weight gets the head's gradient and the embedding's. The
embedding adds its token rows into the head's buffer (:mod:`engine.ops.tied_gradient`)
instead of making a second dense ``[V, H]`` tensor (issue 13: 1.76x the gradient floor of a
tied Qwen3 step). Everything here is compared with the unpatched model: loss, every
gradient, the padding row, hooks, ``autograd.grad``, accumulation over steps, loss scaling,
``inputs_embeds``; and the allocations of the weight's size during backward are counted.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_for
from torch.profiler import ProfilerActivity, profile

import engine

VOCAB, HIDDEN = 4096, 64  # the [V, H] gradient (1 MiB) is larger than anything else in the step


def _pair(name: str = "qwen3", **overrides):
    reference = tiny_for(name, vocab_size=VOCAB, tie_word_embeddings=True, **overrides)
    reference.train()
    assert reference.lm_head.weight is reference.get_input_embeddings().weight
    patched = copy.deepcopy(reference)
    engine.apply(patched, name, device="cpu", fused_cross_entropy={"chunk_size": 7})
    assert patched.lm_head.weight is patched.get_input_embeddings().weight
    return reference, patched


def _batch(model: torch.nn.Module, seq: int = 16) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (2, seq), generator=gen)
    pad = model.get_input_embeddings().padding_idx
    if pad is not None:
        ids[1, -3:] = pad  # the padding row gets nothing from the embedding
    labels = ids.clone()
    labels[1, -3:] = -100
    return {"input_ids": ids, "labels": labels}


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(reference: torch.nn.Module, patched: torch.nn.Module, atol: float = 1e-6) -> None:
    want, got = _grads(reference), _grads(patched)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=atol, msg=name)


@pytest.mark.parametrize("name", ["qwen3", "gemma3_text", "llama"])
def test_tied_gradients_equal_the_unpatched(name: str) -> None:
    reference, patched = _pair(name)
    batch = _batch(reference)
    for model in (reference, patched):
        model(**batch).loss.backward()
    _assert_same_grads(reference, patched)


def _large_allocations_in_backward(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    loss = model(**batch).loss
    size = VOCAB * HIDDEN * 4
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss.backward()
    events = prof.profiler.kineto_results.events()
    return sum(1 for e in events if e.name() == "[memory]" and e.nbytes() >= size)


def test_one_weight_sized_gradient_exists_not_two() -> None:
    reference, patched = _pair("qwen3", hidden_size=HIDDEN)
    batch = _batch(reference)
    # Unpatched: the logits' gradient, the head's and the embedding's dense gradients.
    assert _large_allocations_in_backward(reference, batch) >= 2
    # Fused: the head's gradient is computed in the forward; backward adds the embedding into it.
    assert _large_allocations_in_backward(patched, batch) == 0
    _assert_same_grads(reference, patched)


def test_untied_model_is_not_routed() -> None:
    reference = tiny_for("qwen3", vocab_size=VOCAB, tie_word_embeddings=False).train()
    patched = copy.deepcopy(reference)
    engine.apply(patched, "qwen3", device="cpu", fused_cross_entropy=True)
    batch = _batch(reference)
    for model in (reference, patched):
        model(**batch).loss.backward()
    _assert_same_grads(reference, patched)
    assert reference.get_input_embeddings().weight.grad is not None


def test_accumulation_loss_scaling_and_hooks() -> None:
    reference, patched = _pair()
    batch = _batch(reference)
    seen: dict[str, list[torch.Tensor]] = {"reference": [], "patched": []}
    for key, model in (("reference", reference), ("patched", patched)):
        model.lm_head.weight.register_hook(lambda g, key=key: seen[key].append(g.detach().clone()))
        for scale in (1.0, 0.25):  # two micro-batches into the same .grad, the second scaled
            (model(**batch).loss * scale).backward()
    _assert_same_grads(reference, patched)
    assert len(seen["patched"]) == len(seen["reference"]) == 2  # one sum per backward, as autograd forms it
    for want, got in zip(seen["reference"], seen["patched"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_autograd_grad_and_inputs_embeds() -> None:
    reference, patched = _pair()
    batch = _batch(reference)
    weights = [m.lm_head.weight for m in (reference, patched)]
    want, got = (torch.autograd.grad(m(**batch).loss, [w])[0] for m, w in zip((reference, patched), weights))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert reference.lm_head.weight.grad is None and patched.lm_head.weight.grad is None  # .grad untouched
    for model in (reference, patched):  # the embedding runs outside the forward: autograd sums as usual
        embeds = model.get_input_embeddings()(batch["input_ids"])
        model(inputs_embeds=embeds, labels=batch["labels"]).loss.backward()
    _assert_same_grads(reference, patched)


def test_frozen_tied_weight_trains_the_rest() -> None:
    reference, patched = _pair()
    for model in (reference, patched):
        model.lm_head.weight.requires_grad_(False)
        model(**_batch(model)).loss.backward()
        assert model.lm_head.weight.grad is None
    _assert_same_grads(reference, patched)


@pytest.mark.parametrize("reentrant", [True, False])
def test_gradient_checkpointing(reentrant: bool) -> None:
    reference, patched = _pair()
    batch = _batch(reference)
    for model in (reference, patched):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        model.train()
        model(**batch).loss.backward()
    _assert_same_grads(reference, patched)


def test_int32_input_ids() -> None:
    reference, patched = _pair()
    batch = _batch(reference)
    batch["input_ids"] = batch["input_ids"].to(torch.int32)
    for model in (reference, patched):
        model(**batch).loss.backward()
    _assert_same_grads(reference, patched)
