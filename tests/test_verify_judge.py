"""The judge calibrated by the original's own rounding error, and verification that copies nothing.

* the truth is really fp64, through transformers' own fp32 casts (a model cast to fp64 is not);
* a correct kernel that is not bit-equal passes on a deeper model, a wrong one fails by far;
* ``verify(model, patchset)`` patches in place and leaves the model exactly as it was, on a
  pass and on a failure; the whole model is never deep-copied;
* ``modules="sample"`` checks the first, middle and last module of each class;
* a tokenizer's padded batch works, with ``-100`` labels or none.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_for
from snapshots import assert_same, snapshot

import engine
from engine.kernels import registry
from engine.ops.rms_norm import rms_norm_reference
from engine.patching.patcher import original_forwards
from engine.verification import NOISE_FACTOR, probe_batch, sample_modules
from engine.verification.truth import GradientSink, fp64_truth


def _by_hand_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x, weight = x.double(), weight.double()
    return weight * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])
def test_the_truth_is_fp64_through_transformers_casts(family: str) -> None:
    """Qwen3's norm rounds with ``hidden_states.to(torch.float32)``, Gemma 3's with ``x.float()``, both
    losses with ``logits.float()``: in a model cast to fp64 those casts round to fp32; in the truth they do not."""
    model = tiny_for(family)
    norm = model.model.norm
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    handle = norm.register_forward_hook(lambda m, args, out: seen.append((args[0].detach(), out.detach())))
    batch = probe_batch(model)
    sink = GradientSink(lambda name, grad: grads.__setitem__(name, grad))
    grads: dict[str, torch.Tensor] = {}
    try:
        with fp64_truth(model, sink) as mode:
            out = model(**batch)
            # nothing keeps an fp64 copy of a parameter alive for the backward: autograd saved references
            assert mode._upcasts and all(ref() is None for ref, _ in mode._upcasts.values())
        out.loss.backward()
        sink.flush()
        naive = copy.deepcopy(model).double()  # the trap: casting the model
        naive(**batch)
    finally:
        handle.remove()
    assert not mode.rounded
    assert out.logits.dtype == out.loss.dtype == torch.float64
    offset = 1.0 if family == "gemma3_text" else 0.0  # Gemma's (1 + w) scale
    (x, y), (nx, ny) = seen[0], seen[1]
    assert x.dtype == y.dtype == ny.dtype == torch.float64
    weight, eps = norm.weight.detach().double() + offset, norm.eps if offset else norm.variance_epsilon
    truth_err = float((y - _by_hand_rms_norm(x, weight, eps)).abs().max())
    naive_err = float((ny - _by_hand_rms_norm(nx, weight, eps)).abs().max())
    assert truth_err < 1e-13 and naive_err > 1e-9  # the cast model's norm rounded to fp32 inside
    assert set(grads) == {n for n, p in model.named_parameters()}  # every gradient, in fp64, not in .grad
    assert all(g.dtype == torch.float64 for g in grads.values()) and all(p.grad is None for p in model.parameters())


def _norm_kernel(name: str, fn) -> None:
    registry.register(registry.KernelProvider(name=name, op="rms_norm", devices=registry.ALL_DEVICES,
                                              build=lambda patch: fn))


@pytest.fixture
def norm_kernels():
    def reordered(x, weight, eps):
        """Correct, rounded differently: the scale in fp64, one rounding at the end."""
        return _by_hand_rms_norm(x, weight, eps).to(x.dtype)

    def wrong_eps(x, weight, eps):
        return rms_norm_reference(x, weight, 1e-3)  # a plausible bug: the wrong epsilon

    _norm_kernel("reordered", reordered)
    _norm_kernel("wrong_eps", wrong_eps)
    yield
    registry.unregister("reordered", "rms_norm")
    registry.unregister("wrong_eps", "rms_norm")


def _with_norm_kernel(kernel: str) -> dict:
    ps = engine.load_patchset("qwen3").model_dump(mode="json")
    ps["patches"][0]["kernel"] = kernel
    return ps


def _deep_qwen3() -> torch.nn.Module:
    return tiny_for("qwen3", num_hidden_layers=6, hidden_size=64, intermediate_size=160)


def test_a_correct_kernel_that_is_not_bit_equal_passes_on_a_deeper_model(norm_kernels) -> None:
    model = _deep_qwen3()
    report = engine.verify(model, _with_norm_kernel("reordered"), device="cpu")
    model_checks = {c.what: c for c in report.checks if c.path == "<model>"}
    assert model_checks["logits"].max_abs > 0 and model_checks["grads"].max_abs > 0  # not bit-equal...
    assert report.passed  # ...but within the original's own rounding error
    assert "the original's own error vs fp64" in model_checks["logits"].note
    kernels = [c for c in report.checks if c.what == "kernel" and c.cls == "Qwen3RMSNorm"]
    assert kernels and all(c.passed for c in kernels) and any(c.max_abs > 0 for c in kernels)


def test_a_wrong_kernel_fails_far_beyond_the_original_error(norm_kernels) -> None:
    model = _deep_qwen3()
    before = snapshot(model)
    with pytest.raises(engine.VerificationFailed) as info:
        engine.verify(model, _with_norm_kernel("wrong_eps"), device="cpu")
    assert_same(before, snapshot(model))
    failed = {(c.path, c.what) for c in info.value.report.failures}
    assert ("model.norm", "kernel") in failed and ("<model>", "logits") in failed and ("<model>", "grads") in failed
    logits = next(c for c in info.value.report.checks if c.path == "<model>" and c.what == "logits")
    times = float(logits.note.split(" = ")[1].split("x ")[0])
    assert times > 100 * NOISE_FACTOR  # orders of magnitude, not a close call


def test_a_wrong_declaration_still_fails_bit_exactly(qwen3: torch.nn.Module) -> None:
    ps = {"name": "wrong", "model_types": ["qwen3"],
          "patches": [{"target": "Qwen3RMSNorm", "op": "rms_norm", "scale": "one_plus_weight"}]}
    with pytest.raises(engine.VerificationFailed, match=r"scale: weight(, cast: llama)? fits"):
        engine.verify(qwen3, ps, device="cpu")


def test_verify_with_a_patchset_copies_no_more_than_one_module(qwen3, monkeypatch) -> None:
    """The model is patched in place, never deep-copied; only one module at a time is (for its bf16 check)."""
    copied: list[object] = []
    real = copy.deepcopy
    depth = [0]

    def spy(value, memo=None):
        if depth[0] == 0:  # the outermost call (a cast copy passes a memo of its cast tensors): what was copied
            copied.append(value)
        depth[0] += 1
        try:
            return real(value, memo)
        finally:
            depth[0] -= 1

    monkeypatch.setattr(copy, "deepcopy", spy)
    params = {id(p) for p in qwen3.parameters()}
    used: set[int] = set()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, args: used.update(id(p) for p in m.parameters(recurse=False)))
    try:
        assert engine.verify(qwen3, "qwen3", device="cpu").passed
    finally:
        handle.remove()
    assert qwen3 not in copied and copied  # the per-module checks copy modules...
    patched = {type(m).__name__ for m in copied if isinstance(m, torch.nn.Module)}
    assert patched <= {"Qwen3RMSNorm", "Qwen3MLP"}  # ...one patched module each, never the model
    assert params <= used  # the model's own parameters ran the whole-model checks


def _grads_rng_and_snapshot(model: torch.nn.Module) -> tuple[dict, torch.Tensor, dict]:
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    return {n: p.grad for n, p in model.named_parameters()}, torch.get_rng_state(), snapshot(model)


def _assert_as_before(model: torch.nn.Module, grads: dict, rng: torch.Tensor, before: dict) -> None:
    assert_same(before, snapshot(model))
    assert all(p.grad is grads[n] and bool((p.grad == 0.5).all()) for n, p in model.named_parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_verify_leaves_the_model_exactly_as_it_was_on_a_pass_and_a_failure(qwen3, norm_kernels) -> None:
    batch = probe_batch(qwen3)
    with torch.no_grad():
        logits = qwen3(**batch).logits
    grads, rng, before = _grads_rng_and_snapshot(qwen3)
    state = {k: v.clone() for k, v in qwen3.state_dict().items()}
    assert engine.verify(qwen3, _with_norm_kernel("reordered"), device="cpu").passed
    _assert_as_before(qwen3, grads, rng, before)
    with pytest.raises(engine.VerificationFailed):
        engine.verify(qwen3, _with_norm_kernel("wrong_eps"), device="cpu")
    _assert_as_before(qwen3, grads, rng, before)
    assert not engine.is_patched(qwen3)
    assert all(torch.equal(v, state[k]) for k, v in qwen3.state_dict().items())
    with torch.no_grad():
        assert torch.equal(qwen3(**batch).logits, logits)


def test_verify_of_a_patched_model_keeps_it_patched(qwen3, norm_kernels) -> None:
    engine.apply(qwen3, _with_norm_kernel("reordered"), device="cpu")
    grads, rng, before = _grads_rng_and_snapshot(qwen3)
    batch = probe_batch(qwen3)
    with torch.no_grad():
        patched = qwen3(**batch).logits
    assert engine.verify(qwen3).passed
    _assert_as_before(qwen3, grads, rng, before)
    with torch.no_grad():
        assert torch.equal(qwen3(**batch).logits, patched)
        with original_forwards(qwen3):
            original = qwen3(**batch).logits
        assert not torch.equal(original, patched)  # the context really ran the original forwards...
        assert torch.equal(qwen3(**batch).logits, patched)  # ...and put the patched ones back
    with pytest.raises(KeyError), original_forwards(qwen3):
        raise KeyError("inside")
    assert_same(before, snapshot(qwen3))  # restored on an exception too
    engine.revert(qwen3)


def test_sample_checks_the_first_middle_and_last_module_of_each_class() -> None:
    model = tiny_for("qwen3", num_hidden_layers=5)
    decisions = [d for d in engine.plan(model, "qwen3", device="cpu").decisions if d.action == "patch"]
    chosen = sample_modules(decisions)
    mlps = [d.path for d in chosen if d.cls == "Qwen3MLP"]
    assert mlps == ["model.layers.0.mlp", "model.layers.2.mlp", "model.layers.4.mlp"]
    norms = [d.path for d in decisions if d.cls == "Qwen3RMSNorm"]
    assert [d.path for d in chosen if d.cls == "Qwen3RMSNorm"] == [norms[0], norms[len(norms) // 2], norms[-1]]
    assert any(d.site is not None for d in chosen)  # functions are always checked

    report = engine.apply(model, "qwen3", device="cpu", verify="sample").verification
    checked = {c.path for c in report.checks if c.path != "<model>"}
    assert checked == {d.path for d in chosen}
    assert report.sampled == len(decisions) - len(chosen) > 0 and "not checked one by one" in str(report)
    assert {c.what for c in report.checks if c.path == "<model>"} == {"logits", "loss", "grads"}
    engine.revert(model)
    with pytest.raises(ValueError, match="'all'.*'sample'"):
        engine.verify(model, "qwen3", modules="some")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["the", "a", "press", "printing", "book", "books", "spread", "across", "europe", "cities", "cost", "fell", "scholars", "text"]
    vocab = {"<pad>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")


def test_a_tokenizer_batch_with_padding_and_ignored_labels(qwen3) -> None:
    tokenizer = _tokenizer()
    enc = tokenizer(["the printing press spread across europe", "books fell"], return_tensors="pt", padding=True)
    assert bool((enc["attention_mask"] == 0).any())  # the second text is padded
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    before = snapshot(qwen3)
    with_labels = engine.verify(qwen3, "qwen3", device="cpu", batch={**enc, "labels": labels})
    without = engine.verify(qwen3, "qwen3", device="cpu", batch=enc)  # a BatchEncoding, labels made from it
    assert with_labels.passed and without.passed
    loss = {r: next(c for c in rep.checks if c.what == "loss") for r, rep in (("with", with_labels), ("without", without))}
    assert loss["with"].passed and loss["without"].passed
    assert_same(before, snapshot(qwen3))
    with pytest.raises(ValueError, match="no token is scored"):
        engine.apply(qwen3, "qwen3", device="cpu",
                     verify={"batch": {**enc, "labels": torch.full_like(labels, -100)}})
    assert not engine.is_patched(qwen3)  # the bad batch left the model as it was
    assert_same(before, snapshot(qwen3))


def test_the_truth_runs_where_torch_has_no_fp64_kernel() -> None:
    """transformers' MoE experts call ``grouped_mm``, which has no fp64 kernel: the truth computes it group by group.

    The fused head is not bit-equal, so the truth runs through every expert of the model."""
    model = tiny_for("qwen3_moe").train()
    report = engine.verify(model, "qwen3_moe", device="cpu", fused_cross_entropy=True)
    loss = next(c for c in report.checks if c.what == "loss")
    assert loss.max_abs > 0 and "the original's own error vs fp64" in loss.note
    assert not any("still rounded" in c.note for c in report.checks)


@pytest.mark.parametrize("reentrant", [False, True])
def test_verify_under_gradient_checkpointing(qwen3: torch.nn.Module, reentrant: bool) -> None:
    """A checkpointed layer recomputes its forward in backward, outside the fp64 mode: the truth
    run turns checkpointing off (values are the same), and the model keeps it on afterwards.
    (LlamaFactory turns checkpointing on by default, before our callback verifies.)"""
    qwen3.train()
    qwen3.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    report = engine.verify(qwen3, "qwen3", mode="training")
    assert report.passed, str(report)
    assert all(m.gradient_checkpointing for m in qwen3.model.layers)
    wrong = engine.verify(qwen3, {"name": "wrong", "model_types": ["qwen3"], "patches": [
        {"target": "Qwen3RMSNorm", "op": "rms_norm", "scale": "one_plus_weight", "eps_attr": "variance_epsilon"}]},
        mode="training", raise_on_failure=False)
    assert not wrong.passed
