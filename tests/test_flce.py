"""fused_linear_cross_entropy: the chunked loss and its gradients equal the model's own (fp32 1e-5).

Against real tiny Qwen3 models (unpatched copy as the reference), with ignored labels,
with ``num_items_in_batch``, with several chunks, and the generation path (no labels).
The liger provider cannot run here (Triton, no GPU): its argument mapping is checked
against the installed liger-kernel's signature when it imports, and numerically against a
torch emulator of LigerFusedLinearCrossEntropyFunction's documented contract.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from conftest import tiny_for

import engine
from engine.errors import SignatureMismatch
from engine.kernels.liger_flce import liger_arguments, liger_flce
from engine.ops.base import get_op
from engine.ops.fused_linear_cross_entropy import chunked_linear_cross_entropy, linear_cross_entropy_reference
from engine.verification import compare, probe_batch


def _batch(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    batch = probe_batch(model, seq=24)
    batch["labels"][0, :7] = -100  # padding / prompt tokens the loss ignores
    batch["labels"][1, 20:] = -100
    return batch


def _run(model: torch.nn.Module, batch: dict[str, torch.Tensor], **extra):
    model.zero_grad(set_to_none=True)
    out = model(**batch, **extra)
    out.loss.backward()
    return out, {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunk_size", [None, 5], ids=["one-chunk", "chunks-of-5"])
@pytest.mark.parametrize("num_items", [None, 29], ids=["mean", "num_items_in_batch"])
def test_loss_and_grads_equal_unpatched_fp32(chunk_size: int | None, num_items: int | None) -> None:
    reference = tiny_for("qwen3_flce")
    patched = copy.deepcopy(reference)
    ps = engine.load_patchset("qwen3_flce").model_dump()
    ps["patches"][-1]["chunk_size"] = chunk_size
    engine.apply(patched, ps, device="cpu")
    batch = _batch(reference)
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    ref, ref_grads = _run(reference, batch, **extra)
    pat, pat_grads = _run(patched, batch, **extra)
    assert pat.logits is None  # not materialized in training
    assert abs(float(pat.loss.detach()) - float(ref.loss.detach())) <= 1e-5
    assert pat_grads.keys() == ref_grads.keys() and "lm_head.weight" in pat_grads
    for k in ref_grads:
        assert torch.allclose(pat_grads[k], ref_grads[k], atol=1e-5, rtol=0), k


def test_bf16_within_bf16_rounding() -> None:
    reference = tiny_for("qwen3_flce", dtype=torch.bfloat16)
    patched = copy.deepcopy(reference)
    engine.apply(patched, "qwen3_flce", device="cpu")
    batch = _batch(reference)
    ref, ref_grads = _run(reference, batch)
    pat, pat_grads = _run(patched, batch)
    assert pat.loss.dtype == ref.loss.dtype == torch.float32
    assert abs(float(pat.loss.detach()) - float(ref.loss.detach())) <= 1e-5
    for k in ref_grads:
        assert compare(pat_grads[k], ref_grads[k])[2], k


def test_generation_and_eval_return_the_same_logits() -> None:
    reference = tiny_for("qwen3_flce")
    patched = copy.deepcopy(reference)
    engine.apply(patched, "qwen3_flce", device="cpu")
    batch = _batch(reference)
    with torch.no_grad():
        assert torch.equal(patched(input_ids=batch["input_ids"]).logits, reference(input_ids=batch["input_ids"]).logits)
        last = patched(input_ids=batch["input_ids"], logits_to_keep=1).logits
        assert torch.equal(last, reference(input_ids=batch["input_ids"], logits_to_keep=1).logits)
        patched.eval(), reference.eval()
        out, want = patched(**batch), reference(**batch)  # eval with labels: the model's own path
        assert torch.equal(out.logits, want.logits) and torch.equal(out.loss, want.loss)
    generated = patched.generate(batch["input_ids"][:1, :4], max_new_tokens=3, do_sample=False)
    assert torch.equal(generated, reference.generate(batch["input_ids"][:1, :4], max_new_tokens=3, do_sample=False))


def test_shift_labels_and_tuple_output() -> None:
    reference = tiny_for("qwen3_flce")
    patched = copy.deepcopy(reference)
    engine.apply(patched, "qwen3_flce", device="cpu")
    batch = _batch(reference)
    shift = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[..., 1:]
    want = reference(input_ids=batch["input_ids"], labels=batch["labels"]).loss
    got = patched(input_ids=batch["input_ids"], labels=batch["labels"], shift_labels=shift, return_dict=False)
    assert isinstance(got, tuple) and abs(float(got[0].detach()) - float(want.detach())) <= 1e-5


def test_kernel_matches_reference_with_grads_and_grad_output() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    target = torch.randint(0, 50, (37,), generator=gen)
    target[::4] = -100
    results = []
    for fn in (linear_cross_entropy_reference, chunked_linear_cross_entropy):
        loss = fn(hidden, weight, target, chunk_size=8)
        (3.0 * loss).backward()  # grad_output != 1
        results.append((loss.detach(), hidden.grad.clone(), weight.grad.clone()))
        hidden.grad = weight.grad = None
    for got, want in zip(results[1], results[0], strict=True):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), (got - want).abs().max()


def test_refuses_softcapping_and_custom_loss() -> None:
    model = tiny_for("qwen3_flce")
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(SignatureMismatch, match="soft-caps"):
        engine.apply(model, "qwen3_flce", device="cpu")
    model.config.final_logit_softcapping = None
    model.loss_function = lambda **kw: 0
    before = model.forward
    with pytest.raises(SignatureMismatch, match="ForCausalLMLoss"):
        engine.apply(model, "qwen3_flce", device="cpu")
    assert model.forward == before and not engine.patcher.is_patched(model)


class _EmulatedLigerFLCE(torch.autograd.Function):
    """Torch emulator of LigerFusedLinearCrossEntropyFunction's documented contract (0.8.5 signature)."""

    @staticmethod
    def forward(ctx, _input, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
                label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None,
                use_token_scaling=False, return_token_accuracy=False, return_predicted_tokens=False,
                ce_impl=None, ce_mode=None, chunk_mem_const=1):
        assert bias is None and softcap is None and lse_square_scale == 0.0 and label_smoothing == 0.0
        assert accum_dtype is torch.float32 and not return_z_loss
        with torch.enable_grad():
            h, w = _input.detach().requires_grad_(), weight.detach().requires_grad_()
            logits = torch.nn.functional.linear(h, w).float()
            loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
            gh, gw = torch.autograd.grad(loss, (h, w))
        ctx.save_for_backward(gh, gw)
        return loss.detach(), None, None, None

    @staticmethod
    def backward(ctx, grad, *_):
        gh, gw = ctx.saved_tensors
        return (gh * grad, gw * grad) + (None,) * 16


@pytest.mark.parametrize("num_items", [None, 29])
def test_liger_mapping_against_emulated_contract(num_items: int | None) -> None:
    reference = tiny_for("qwen3_flce")
    patched = copy.deepcopy(reference)
    engine.apply(patched, "qwen3_flce", device="cpu")
    ours = patched.forward
    kernel = liger_flce(_EmulatedLigerFLCE)
    patched.forward = get_op("fused_linear_cross_entropy").bind(  # same binding, liger kernel
        patched, engine.load_patchset("qwen3_flce").patches[-1], kernel
    ).__get__(patched)
    batch = _batch(reference)
    extra = {} if num_items is None else {"num_items_in_batch": num_items}
    ref, ref_grads = _run(reference, batch, **extra)
    pat, pat_grads = _run(patched, batch, **extra)
    patched.forward = ours
    assert abs(float(pat.loss.detach()) - float(ref.loss.detach())) <= 1e-5
    for k in ref_grads:
        assert torch.allclose(pat_grads[k], ref_grads[k], atol=1e-5, rtol=0), k


def test_liger_mapping_matches_installed_signature() -> None:
    liger = pytest.importorskip("liger_kernel.ops.fused_linear_cross_entropy")
    forward = liger.LigerFusedLinearCrossEntropyFunction.forward
    args = liger_arguments(forward, _input="h", weight="w", target="t", ignore_index=-7, reduction="sum",
                           accum_dtype=torch.float32)
    names = list(inspect.signature(forward).parameters)[1:]
    assert dict(zip(names, args))["reduction"] == "sum" and args[:3] == ("h", "w", "t")
    assert dict(zip(names, args))["ignore_index"] == -7
