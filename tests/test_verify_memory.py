"""The fp64 truth without a whole fp64 copy of a large embedding or LM head, and a chunked compare.

A 262k-token vocabulary makes the embedding (tied to the head in Gemma 3) 1.3 GiB in fp64:
the truth looks up only the rows it needs, multiplies by the head a block of rows at a
time and takes the cross-entropy of the scores a block of rows at a time
(:class:`engine.verification.truth._WideRows`, ``_WideLinear``, ``_WideCrossEntropy``). Here every parameter
counts as large (``_BIG = 0``), and the results must be those of the whole-copy path, which
the tiny models otherwise take: logits, loss, every gradient (the tied weight's two uses summed).
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any

import pytest
import torch
from conftest import tiny_for

import engine
from engine.verification import gradient_hooks, models, probe_batch
from engine.verification import truth as truth_mod
from engine.verification.compare import compare
from engine.verification.truth import GradientSink, fp64_truth
from engine.verification.truth_layers import recomputed_layers


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
    batch["labels"] = batch["input_ids"].masked_fill(batch["input_ids"] == 3, -100)  # ignored: no loss, no gradient
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


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_blockwise_cross_entropy_is_torch_s_in_fp64(reduction: str, monkeypatch) -> None:
    monkeypatch.setattr(truth_mod, "_BIG", 64)  # blocks of one row: 64 // 8 elements of a 37-wide score row
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(11, 37, generator=gen, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 37, (11,), generator=gen)
    target[[2, 7]] = -100
    seed = torch.randn(11, generator=gen, dtype=torch.float64)
    with fp64_truth(None) as mode:
        mine = torch.nn.functional.cross_entropy(x, target, reduction=reduction)
    assert mine.grad_fn is not None and "WideCrossEntropy" in type(mine.grad_fn).__name__
    want = torch.nn.functional.cross_entropy(x, target, reduction=reduction)
    assert torch.allclose(mine, want, rtol=1e-13, atol=1e-15) and not mode.rounded
    weight = seed if reduction == "none" else 1.0
    (g_mine,) = torch.autograd.grad((mine * weight).sum(), x)
    (g_want,) = torch.autograd.grad((want * weight).sum(), x)
    assert torch.allclose(g_mine, g_want, rtol=1e-12, atol=1e-15) and bool((g_mine[[2, 7]] == 0).all())


@pytest.mark.parametrize("z_loss", [False, True])
def test_the_cross_entropy_writes_its_gradient_into_scores_only_nothing_else_reads(z_loss: bool, monkeypatch) -> None:
    """Once the caller dropped the outputs, the scores' gradient takes their place, unless another backward saved them."""
    monkeypatch.setattr(truth_mod, "_BIG", 0)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(11, 37, generator=gen, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 37, (11,), generator=gen)
    free: list[bool] = []
    backward = truth_mod._WideCrossEntropy.backward

    def watched(ctx: Any, grad: torch.Tensor) -> Any:
        free.append(ctx.mode.scores_free(ctx.saved_tensors[0]))
        out = backward(ctx, grad)
        assert (out[0].untyped_storage().data_ptr() == ctx.saved_tensors[0].untyped_storage().data_ptr()) == free[-1]
        return out

    monkeypatch.setattr(truth_mod._WideCrossEntropy, "backward", staticmethod(watched))

    def loss_of(scores: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.cross_entropy(scores, target)
        return loss + 1e-2 * torch.logsumexp(scores, -1).square().mean() if z_loss else loss  # a z-loss saves the scores

    for dropped in (False, True):
        with fp64_truth(None) as mode:
            loss = loss_of(w * 1.5)  # the scores: nothing but the graph holds them
        mode.outputs_dropped = dropped
        (mine,) = torch.autograd.grad(loss, w)
        (want,) = torch.autograd.grad(loss_of(w * 1.5), w)
        assert torch.allclose(mine, want, rtol=1e-12, atol=1e-15)
    assert free == [False, not z_loss]


def _layered_truth(model: torch.nn.Module, batch: dict, *, layered: bool, seed: int = 0) -> tuple[Any, ...]:
    """The truth through ``models``' path: decoder layers recomputed, head gradients handed over in row blocks."""
    whole: dict[str, torch.Tensor] = {}
    parts: dict[str, torch.Tensor] = {}
    cover: dict[str, torch.Tensor] = {}
    shapes = {n: p.shape for n, p in model.named_parameters()}

    def part(name: str, rows: Any, values: torch.Tensor) -> None:
        parts.setdefault(name, torch.zeros(shapes[name], dtype=torch.float64))[rows] = values
        cover.setdefault(name, torch.zeros(shapes[name][0], dtype=torch.int64))[rows] += 1

    done: list[str] = []
    sink = GradientSink(whole.__setitem__, on_part=part if layered else None,
                        on_done=done.append if layered else None)
    truth = fp64_truth(model, sink)
    torch.manual_seed(seed)
    with recomputed_layers(model, truth.mode) if layered else contextlib.nullcontext(0) as layers:
        with truth as mode:
            out = model(**batch, use_cache=False)
        out.loss.backward()
    sink.flush()
    assert not mode.rounded
    return out.logits.detach(), out.loss.detach(), whole, parts, cover, done, layers


@pytest.mark.parametrize("family", ["gemma3_text", "qwen3"])
def test_the_truth_layer_by_layer_and_in_row_blocks_equals_the_truth_at_once(family: str, monkeypatch) -> None:
    model = tiny_for(family, tie_word_embeddings=True, pad_token_id=3, attention_dropout=0.3).train()
    batch = probe_batch(model)
    batch["input_ids"][0, :3] = 3
    monkeypatch.setattr(truth_mod, "_BIG", 0)  # the tied embedding and head go through the blockwise path
    at_once = _layered_truth(model, batch, layered=False)
    layered = _layered_truth(model, batch, layered=True)
    assert layered[6] == model.config.num_hidden_layers  # every decoder layer recomputed in its backward
    assert not torch.equal(_layered_truth(model, batch, layered=False, seed=1)[0], at_once[0])  # dropout draws
    assert torch.equal(layered[0], at_once[0]) and torch.equal(layered[1], at_once[1])  # the same fp64 operations
    name = next(n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight)
    assert name not in layered[2] and name in layered[5]  # never handed over whole: in row blocks, then done
    assert bool((layered[4][name] == 1).all())  # each row exactly once, its final value
    grads = {**layered[2], **layered[3]}
    assert grads.keys() == at_once[2].keys() == {n for n, _ in model.named_parameters()}
    for key, grad in at_once[2].items():
        assert torch.equal(grads[key], grad), key  # bit for bit, dropout included
    assert torch.equal(grads[name][3], at_once[2][name][3]) and grads[name][3].abs().max() > 0  # padding row: head only


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


# ---- where what waits to be compared is kept ------------------------------------------------


def test_auto_keeps_what_waits_on_the_host_when_the_model_is_not_on_the_cpu() -> None:
    model = tiny_for("qwen3")
    assert models.holding_device(model) == torch.device("cpu")  # a CPU model: host and device are one memory
    assert models.holding_device(model, "none") == torch.device("cpu")
    on_meta = tiny_for("qwen3").to("meta")  # any device that is not the host's memory (an accelerator's)
    assert models.holding_device(on_meta) == torch.device("cpu")
    assert models.holding_device(on_meta, "host") == torch.device("cpu")
    assert models.holding_device(on_meta, "none") == torch.device("meta")
    assert models.holding_device(on_meta, "meta") == torch.device("meta")


def test_each_held_buffer_lives_on_the_holding_device_and_gradients_leave_the_model_as_they_arrive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every tensor the whole-model check keeps between runs goes through ``hold`` to the holding device.

    The original's gradients are taken as autograd forms them: when one is taken, no other
    parameter holds a gradient (on an accelerator the device never holds the original's set).
    The numbers are those of keeping everything where it is.
    """
    model = tiny_for("qwen3")
    engine.apply(model, "qwen3", fused_cross_entropy=True)  # not bit-equal (the fused loss): the truth runs
    batch = probe_batch(model)
    try:
        baseline = engine.verify(model, batch=batch, offload="none")
        kept: list[tuple[torch.device, torch.device, int]] = []  # (where it was, where it is kept, other grads)
        real_hold = models.hold

        def spy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
            out = real_hold(t, device)
            kept.append((t.device, out.device, sum(p.grad is not None for p in model.parameters())))
            return out

        monkeypatch.setattr(models, "hold", spy)
        monkeypatch.setattr(gradient_hooks, "hold", spy)  # the original's gradients, held as autograd makes them
        report = engine.verify(model, batch=batch, offload="host")
    finally:
        engine.revert(model)
    trainable = sum(p.requires_grad for p in model.parameters())
    assert len(kept) >= trainable + 4  # every original gradient, two logits and two losses (the truth's: judged as made)
    assert all(where == torch.device("cpu") for _, where, _ in kept)
    grads = [others for _, _, others in kept if others]
    assert grads and max(grads) == 1  # the one gradient being taken, none left behind
    assert [(c.path, c.what, c.passed, c.max_abs) for c in report.checks] == [
        (c.path, c.what, c.passed, c.max_abs) for c in baseline.checks]
    assert any(c.what == "grads" and c.note and "original's own error" in c.note for c in report.checks)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("fused", [False, True], ids=["head", "fused-head"])
def test_the_original_logits_are_not_held_through_the_patched_run_on_a_cpu(
    fused: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where held and model memory are one (a CPU), the original's logits are compared with the
    patched ones and dropped before the patched backward (the verification's peak), then
    recomputed for the truth by a forward without a graph: every check as when they are kept."""
    import weakref

    from engine.kernels import registry

    def fp64_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """Correct and rounded once (fp64 inside): not bit-equal, so the truth runs."""
        x64 = x.double()
        return (weight.double() * x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + eps)).to(x.dtype)

    registry.register(registry.KernelProvider(name="fp64_inside", op="rms_norm", devices=registry.ALL_DEVICES,
                                              build=lambda patch: fp64_norm))
    ps = engine.load_patchset("qwen3").model_dump(mode="json")
    ps["patches"][0]["kernel"] = "fp64_inside"
    model = tiny_for("qwen3", num_hidden_layers=4)
    with contextlib.ExitStack() as cleanup:
        cleanup.callback(registry.unregister, "fp64_inside", "rms_norm")
        engine.apply(model, ps, fused_cross_entropy=fused)
        batch = probe_batch(model)
        try:
            monkeypatch.setattr(models._OriginalOutput, "drop", lambda self: None)  # kept, as on an accelerator
            kept = engine.verify(model, batch=batch, raise_on_failure=False)
            monkeypatch.undo()
            held: list[weakref.ref] = []
            alive_at_backward: list[bool] = []
            real_hold, real_run = models.hold, models._run

            def spy(t: torch.Tensor, device: torch.device) -> torch.Tensor:
                out = real_hold(t, device)
                if out.dim() == 3 and not held:
                    held.append(weakref.ref(out))  # the first [batch, tokens, vocab] held: the original's logits
                return out

            def run(m: Any, b: Any, forward_in: Any = None, between: Any = None, scenario: Any = None) -> Any:
                def then(out: Any) -> None:
                    if between is not None:
                        between(out)
                    alive_at_backward.append(bool(held) and held[0]() is not None)
                return real_run(m, b, forward_in, then, scenario)

            monkeypatch.setattr(models, "hold", spy)
            monkeypatch.setattr(models, "_run", run)
            dropped = engine.verify(model, batch=batch, raise_on_failure=False)
        finally:
            engine.revert(model)
    assert held and alive_at_backward[1] is False  # gone before the patched run's backward
    assert any(c.what == "grads" and "original's own error" in c.note for c in dropped.checks)  # the truth ran
    assert [(c.path, c.what, c.dtype, c.passed, c.max_abs, c.note) for c in dropped.checks] == [
        (c.path, c.what, c.dtype, c.passed, c.max_abs, c.note) for c in kept.checks]
