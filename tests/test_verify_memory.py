"""The fp64 truth without a whole fp64 copy of a large embedding or LM head, and a chunked compare.

A 262k-token vocabulary makes the embedding (tied to the head in Gemma 3) 1.3 GiB in fp64:
the truth looks up only the rows it needs and multiplies by the head a block of rows at a
time (:class:`engine.verification.truth._WideRows`, ``_WideLinear``). Here every parameter
counts as large (``_BIG = 0``), and the results must be those of the whole-copy path, which
the tiny models otherwise take: logits, loss, every gradient (the tied weight's two uses summed).
"""

from __future__ import annotations

import importlib

import pytest
import torch
from conftest import tiny_for

from engine.verification import probe_batch
from engine.verification import truth as truth_mod
from engine.verification.compare import compare
from engine.verification.truth import GradientSink, fp64_truth


def _truth(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor, dict, set]:
    grads: dict[str, torch.Tensor] = {}
    sink = GradientSink(lambda name, grad: grads.__setitem__(name, grad))
    with fp64_truth(model, sink) as mode:
        out = model(**batch)
        upcast = {id(p) for _, p in mode._upcasts.values()}
    out.loss.backward()
    sink.flush()
    assert not mode.rounded
    return out.logits.detach(), out.loss.detach(), grads, upcast


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3"])
def test_the_truth_in_blocks_equals_the_truth_with_whole_copies(family: str, monkeypatch) -> None:
    model = tiny_for(family, tie_word_embeddings=True, pad_token_id=3)
    batch = probe_batch(model)
    batch["input_ids"][0, :3] = 3  # the padding row: no gradient from its lookups, as in F.embedding
    whole = _truth(model, batch)
    monkeypatch.setattr(truth_mod, "_BIG", 0)
    blocks = _truth(model, batch)
    embedding = model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight is embedding  # one parameter, two uses
    assert id(embedding) in whole[3] and id(embedding) not in blocks[3]  # never upcast whole in blocks
    assert torch.allclose(blocks[0], whole[0], rtol=1e-12, atol=1e-12)
    assert torch.allclose(blocks[1], whole[1], rtol=1e-12, atol=1e-12)
    assert blocks[2].keys() == whole[2].keys() == {n for n, _ in model.named_parameters()}
    for name, grad in whole[2].items():
        assert torch.allclose(blocks[2][name], grad, rtol=1e-10, atol=1e-12), name
    name = next(n for n, p in model.named_parameters() if p is embedding)
    assert blocks[2][name][3].abs().max() > 0  # the head's use still reaches the padding row


def test_compare_in_chunks_equals_compare_at_once(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(37, 11, generator=gen)
    b = a + 1e-6 * torch.randn(37, 11, generator=gen)
    at_once = compare(a, b)
    monkeypatch.setattr(importlib.import_module("engine.verification.compare"), "_CHUNK", 16)
    assert compare(a, b) == at_once and at_once[0] > 0
    assert compare(a, a) == (0.0, 0.0, True)
    c, d = a.clone(), a.clone()
    c[30, 0] = d[30, 0] = float("nan")
    assert compare(c, d) == (0.0, 0.0, True)  # non-finite in the last chunk only: equal where the values are
    d[30, 1] += 1.0
    assert compare(c, d) == (float("inf"), float("inf"), False)
