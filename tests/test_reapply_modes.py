"""Issue 11, scenario 3: mode flips and re-applying the patchset a model already has.

Applying the same patchset again is never an error: the same kernels make it a no-op, a mode
that needs other kernels (inference kernels without a backward, then ``model.train()``)
re-plans. Another patchset is refused. A kernel without a backward never computes gradients:
the patched forward refuses first. Numbers are compared with the unpatched model (fp32, 1e-5).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch
from conftest import tiny_for
from snapshots import assert_same, snapshot
from training_helpers import grads, max_diff
from transformers import Trainer, TrainingArguments

import engine
from engine.integrations.transformers import PatchsetCallback
from engine.kernels import registry
from engine.ops.rms_norm import rms_norm_reference
from engine.patching.patcher import applied_report
from engine.schema import Device

TOL = 1e-5


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), grads(model)


@pytest.fixture
def ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.fixture
def inference_only_norm(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """A real provider without a backward (as an inference kernel is), first in ``auto``'s CPU order.

    It computes the reference under ``no_grad``: right values, no autograd graph, so any
    gradient through it would be silently wrong (missing) if the engine let it run.
    """
    calls: list[int] = []

    def build(patch):  # type: ignore[no-untyped-def]
        def kernel(x, weight, eps):  # type: ignore[no-untyped-def]
            calls.append(1)
            with torch.no_grad():
                return rms_norm_reference(x, weight, eps, scale=patch.scale, cast=patch.cast, precision=patch.precision)

        return kernel

    registry.register(registry.KernelProvider(
        name="inference_only", op="rms_norm", devices=registry.ALL_DEVICES, build=build, has_backward=False,
        description="test: an inference kernel"))
    monkeypatch.setitem(registry.AUTO_ORDER, Device.cpu, ("inference_only", "torch"))
    try:
        yield calls
    finally:
        registry.unregister("inference_only", "rms_norm")


def test_apply_in_eval_then_train_then_apply_again_is_not_an_error(qwen3: torch.nn.Module, ids: torch.Tensor) -> None:
    reference = copy.deepcopy(qwen3).train()
    qwen3.eval()
    first = engine.apply(qwen3, "qwen3", device="cpu")
    assert first.mode == "inference"
    forwards = {n: m.__dict__.get("forward") for n, m in qwen3.named_modules()}
    qwen3.train()
    try:
        again = engine.apply(qwen3, "qwen3", device="cpu")  # was AlreadyPatched
        assert again is first and again.mode == "training"  # same kernels: nothing reinstalled
        assert forwards == {n: m.__dict__.get("forward") for n, m in qwen3.named_modules()}
        loss, g = _loss_and_grads(qwen3, ids)
        ref_loss, ref_g = _loss_and_grads(reference, ids)
        assert abs(loss.item() - ref_loss.item()) <= TOL and max_diff(g, ref_g) <= TOL
    finally:
        engine.revert(qwen3)


def test_another_patchset_is_still_refused_and_changes_nothing(qwen3: torch.nn.Module) -> None:
    engine.apply(qwen3, "qwen3", device="cpu")
    before = snapshot(qwen3)
    other = engine.load_patchset("qwen3").model_dump(mode="json")
    other["name"], other["patches"] = "qwen3-norms-only", other["patches"][:1]
    try:
        with pytest.raises(engine.AlreadyPatched) as info:
            engine.apply(qwen3, other, device="cpu")
        assert "'qwen3'" in str(info.value) and "'qwen3-norms-only'" in str(info.value)
        assert "revert first" in str(info.value)
        assert_same(before, snapshot(qwen3))
    finally:
        engine.revert(qwen3)


def test_patchset_callback_on_a_model_the_user_already_patched(qwen3: torch.nn.Module, ids, tmp_path) -> None:
    """The README's one-liner on a model patched by hand (in eval, as from_pretrained returns it)."""
    reference = copy.deepcopy(qwen3).train()
    qwen3.eval()
    engine.apply(qwen3, "qwen3")
    callback = PatchsetCallback("qwen3")
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, report_to=[], use_cpu=True,
                             save_strategy="no", disable_tqdm=True)
    try:
        trainer = Trainer(model=qwen3, args=args, train_dataset=[{"input_ids": ids[0], "labels": ids[0]}],
                          callbacks=[callback])  # on_init_end applies "qwen3" for training: was AlreadyPatched
        assert trainer.model is qwen3 and callback.report is not None and callback.report.mode == "training"
        qwen3.train()
        loss, g = _loss_and_grads(qwen3, ids)
        ref_loss, ref_g = _loss_and_grads(reference, ids)
        assert abs(loss.item() - ref_loss.item()) <= TOL and max_diff(g, ref_g) <= TOL
    finally:
        engine.revert(qwen3)


def test_no_backward_kernel_refuses_gradients_and_reapply_replans(
    qwen3: torch.nn.Module, ids: torch.Tensor, inference_only_norm: list[int]
) -> None:
    reference = copy.deepcopy(qwen3)
    before = snapshot(qwen3)
    qwen3.eval()
    report = engine.apply(qwen3, "qwen3", device="cpu")
    assert {d.kernel for d in report.decisions if d.op == "rms_norm"} == {"inference_only"}
    try:
        with torch.no_grad():  # inference: the kernel runs and is exact
            logits = qwen3(input_ids=ids).logits
            ref_logits = reference.eval()(input_ids=ids).logits
        assert inference_only_norm and (logits - ref_logits).abs().max().item() <= TOL

        qwen3.train()
        with pytest.raises(engine.BackwardUnsupported) as info:  # never a loss with wrong gradients
            qwen3(input_ids=ids, labels=ids)
        message = str(info.value)
        assert "'inference_only'" in message and "no backward" in message and "engine.apply(model, patchset)" in message
        assert "model.layers.0." in message or "model.norm" in message

        replanned = engine.apply(qwen3, "qwen3", device="cpu")  # same patchset, now for training
        assert replanned.mode == "training"
        assert {d.kernel for d in replanned.decisions if d.op == "rms_norm"} == {"torch"}
        assert any("inference_only: no backward" in d.reason for d in replanned.decisions if d.op == "rms_norm")
        loss, g = _loss_and_grads(qwen3, ids)
        ref_loss, ref_g = _loss_and_grads(reference.train(), ids)
        assert abs(loss.item() - ref_loss.item()) <= TOL and max_diff(g, ref_g) <= TOL
    finally:
        assert engine.revert(qwen3) is True
        qwen3.train()
    assert_same(before, snapshot(qwen3))


def test_a_replan_that_fails_leaves_the_model_as_it_was(
    qwen3: torch.nn.Module, ids: torch.Tensor, inference_only_norm: list[int]
) -> None:
    """Explicit inference kernel, then training: the re-plan is refused and the inference patch stays."""
    ps = engine.load_patchset("qwen3").model_dump(mode="json")
    for patch in ps["patches"]:
        patch["kernel"] = "inference_only" if patch["op"] == "rms_norm" else "torch"
    qwen3.eval()
    # the test's own kernel has no backward, which the whole-model verification runs: applied unverified on purpose
    engine.apply(qwen3, ps, device="cpu", unverified="trust")
    before = snapshot(qwen3)
    qwen3.train()
    try:
        with pytest.raises(engine.DeviceUnsupported, match="inference_only has no backward"):
            engine.apply(qwen3, ps, device="cpu", unverified="trust")
        assert_same(before, snapshot(qwen3))
        assert applied_report(qwen3).mode == "inference"  # type: ignore[union-attr]
    finally:
        engine.revert(qwen3)


# -- the fused head is an option of the patchset, not another patchset (issue 13 follow-up) ----------


def _heads(model: torch.nn.Module) -> list[str]:
    report = applied_report(model)
    assert report is not None
    return [d.kernel for d in report.decisions if d.op == "fused_linear_cross_entropy"]  # type: ignore[misc]


def test_switching_the_fused_head_on_and_off_replans(qwen3: torch.nn.Module, ids: torch.Tensor) -> None:
    reference = copy.deepcopy(qwen3).train()
    ref_loss, ref_g = _loss_and_grads(reference, ids)
    before = snapshot(qwen3)
    qwen3.train()
    engine.apply(qwen3, "qwen3", device="cpu")
    try:
        assert _heads(qwen3) == []
        on = engine.apply(qwen3, "qwen3", device="cpu", fused_cross_entropy={"chunk_size": 5})  # was AlreadyPatched
        assert _heads(qwen3) == ["torch"] and on is applied_report(qwen3)
        out = qwen3(input_ids=ids, labels=ids)
        assert out.logits is None  # the fused head ran: no [tokens, vocab] logits in training
        loss, g = _loss_and_grads(qwen3, ids)
        assert abs(loss.item() - ref_loss.item()) <= TOL and max_diff(g, ref_g) <= TOL

        same = engine.apply(qwen3, "qwen3", device="cpu")  # no opinion (None): the head stays as it is
        assert same is on and _heads(qwen3) == ["torch"]
        other_chunks = engine.apply(qwen3, "qwen3", device="cpu", fused_cross_entropy={"chunk_size": 7})
        assert other_chunks is not on  # other settings: re-planned
        assert [d.patch.chunk_size for d in other_chunks.decisions if d.op == "fused_linear_cross_entropy"] == [7]

        engine.apply(qwen3, "qwen3", device="cpu", fused_cross_entropy=False)
        assert _heads(qwen3) == [] and qwen3(input_ids=ids, labels=ids).logits is not None
        loss, g = _loss_and_grads(qwen3, ids)
        assert abs(loss.item() - ref_loss.item()) <= TOL and max_diff(g, ref_g) <= TOL
    finally:
        assert engine.revert(qwen3) is True
    assert_same(before, snapshot(qwen3))


def test_another_version_of_the_same_name_is_refused_with_both_files(qwen3: torch.nn.Module, tmp_path) -> None:
    engine.apply(qwen3, "qwen3", device="cpu")
    edited = engine.load_patchset("qwen3").model_dump(mode="json")
    edited["patches"] = edited["patches"][:1]
    try:
        with pytest.raises(engine.AlreadyPatched) as info:
            engine.apply(qwen3, edited, device="cpu")
        message = str(info.value)
        assert "another version of 'qwen3'" in message and "qwen3.yaml" in message and "engine.revert(model)" in message
    finally:
        engine.revert(qwen3)
