"""fused_linear_cross_entropy: the kernels, the switch, and the liger mapping (CUDA and Ascend).

The chunked torch kernel against the materializing reference (fp32 1e-6; bf16 no further from
the fp32 truth than plain bf16 autograd is), the ``fused_cross_entropy`` switch (YAML key,
``apply`` option, qwen3_flce), and the liger provider: it cannot run here (Triton, no GPU, no
NPU), so its argument mapping is checked against the installed liger-kernel's signatures
(the CUDA class by import, the Ascend backend's by reading its source, which imports only
with triton-ascend) and numerically against a torch emulator of the documented contract.
"""

from __future__ import annotations

import ast
import copy
import importlib.util
import inspect
from pathlib import Path

import pytest
import torch
from conftest import tiny_for

import engine
from engine.errors import PatchsetError, SignatureMismatch
from engine.kernels.liger_flce import liger_arguments, liger_flce
from engine.ops.flce_torch import chunked_linear_cross_entropy, linear_cross_entropy_reference
from engine.verification import probe_batch


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


def _inputs(dtype: torch.dtype = torch.float32, n: int = 37, h: int = 16, v: int = 50):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen).to(dtype).requires_grad_()
    weight = (0.5 * torch.randn(v, h, generator=gen)).to(dtype).requires_grad_()
    target = torch.randint(0, v, (n,), generator=gen)
    target[::4] = -100
    return hidden, weight, target


def _loss_and_grads(fn, hidden, weight, target, scale: float = 3.0, **kw):
    hidden.grad = weight.grad = None
    loss = fn(hidden, weight, target, **kw)
    (scale * loss).backward()  # grad_output != 1: scaled in place
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["plain", "softcap"])
@pytest.mark.parametrize("chunk_size", [None, 1, 8], ids=["auto", "chunk1", "chunk8"])
@pytest.mark.parametrize("num_items", [None, 29])
def test_chunked_kernel_matches_reference_fp32(softcap, chunk_size, num_items) -> None:
    hidden, weight, target = _inputs()
    kw = {"softcap": softcap, "chunk_size": chunk_size, "num_items_in_batch": num_items}
    want = _loss_and_grads(linear_cross_entropy_reference, hidden, weight, target, **kw)
    got = _loss_and_grads(chunked_linear_cross_entropy, hidden, weight, target, **kw)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("softcap", [None, 2.0], ids=["plain", "softcap"])
def test_bf16_is_as_close_to_the_fp32_truth_as_plain_bf16(softcap) -> None:
    """bf16 head-gradient accumulation in place: no further from fp32 than transformers' own bf16 path."""
    truth = _loss_and_grads(linear_cross_entropy_reference, *_inputs(torch.float32, n=96, h=32, v=300),
                            softcap=softcap)
    plain = _loss_and_grads(linear_cross_entropy_reference, *_inputs(torch.bfloat16, n=96, h=32, v=300),
                            softcap=softcap)
    ours = _loss_and_grads(chunked_linear_cross_entropy, *_inputs(torch.bfloat16, n=96, h=32, v=300),
                           softcap=softcap, chunk_size=16)  # 6 chunks accumulated in bf16
    assert ours[0].dtype == torch.float32 and ours[2].dtype == torch.bfloat16
    for o, p, t in zip(ours, plain, truth, strict=True):
        err_ours = (o.double() - t.double()).abs().max().item()
        err_plain = (p.double() - t.double()).abs().max().item()
        scale = t.abs().max().item()
        assert err_ours <= max(2 * err_plain, scale * 2**-8), (err_ours, err_plain, scale)


def test_backward_twice_is_a_clear_error() -> None:
    hidden, weight, target = _inputs()
    loss = chunked_linear_cross_entropy(hidden, weight, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward runs once per forward"):
        loss.backward()


# -- the switch -------------------------------------------------------------------------------


def test_qwen3_flce_is_qwen3_with_the_switch_on() -> None:
    a, b = tiny_for("qwen3"), tiny_for("qwen3")
    via_yaml = engine.apply(a, "qwen3_flce", device="cpu", mode="training")
    via_option = engine.apply(b, "qwen3", device="cpu", mode="training", fused_cross_entropy=True)
    summary = [(d.path, d.op, d.kernel) for d in via_yaml.decisions]
    assert summary == [(d.path, d.op, d.kernel) for d in via_option.decisions]
    assert ("", "fused_linear_cross_entropy", "torch") in summary
    batch = _batch(a)
    assert a(**batch).logits is None and b(**batch).logits is None


def test_switch_off_and_settings() -> None:
    model = tiny_for("qwen3")
    report = engine.apply(model, "qwen3_flce", device="cpu", mode="training", fused_cross_entropy=False)
    assert "fused_linear_cross_entropy" not in {d.op for d in report.decisions}
    assert model(**_batch(model)).logits is not None
    engine.revert(model)
    report = engine.apply(model, "qwen3", device="cpu", mode="training",
                          fused_cross_entropy={"kernel": {"cpu": "torch"}, "chunk_size": 3})
    (fused,) = [d for d in report.decisions if d.op == "fused_linear_cross_entropy"]
    assert fused.patch.chunk_size == 3 and fused.cls == "Qwen3ForCausalLM"


def test_switch_as_a_yaml_key_and_its_errors(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("name: mine\nextends: qwen3\nmodel_types: [qwen3]\nfused_cross_entropy: {chunk_sise: 3}\n")
    with pytest.raises(PatchsetError, match="chunk_sise"):
        engine.load_patchset(path)
    path.write_text("name: mine\nextends: qwen3\nmodel_types: [qwen3]\nfused_cross_entropy: {chunk_size: 3}\n")
    model = tiny_for("qwen3")
    report = engine.apply(model, path, device="cpu", mode="training")
    assert any(d.op == "fused_linear_cross_entropy" and d.patch.chunk_size == 3 for d in report.decisions)


def test_a_model_without_a_loss_is_refused_and_unchanged() -> None:
    base = tiny_for("qwen3").model  # Qwen3Model: no head, no labels
    base.config.model_type = "qwen3"
    with pytest.raises(SignatureMismatch, match="takes no `labels`"):
        engine.apply(base, "qwen3", device="cpu", fused_cross_entropy=True)
    assert not engine.patching.patcher.is_patched(base)


def test_refuses_a_custom_loss_function() -> None:
    model = tiny_for("qwen3")
    model.loss_function = lambda **kw: 0
    before = model.forward
    with pytest.raises(SignatureMismatch, match="ForCausalLMLoss"):
        engine.apply(model, "qwen3_flce", device="cpu")
    assert model.forward == before and not engine.patching.patcher.is_patched(model)


def test_bf16_model_within_bf16_rounding() -> None:
    from engine.verification import compare

    reference = tiny_for("qwen3", dtype=torch.bfloat16)
    patched = copy.deepcopy(reference)
    engine.apply(patched, "qwen3", device="cpu", fused_cross_entropy=True)
    batch = _batch(reference)
    ref, ref_grads = _run(reference, batch)
    pat, pat_grads = _run(patched, batch)
    assert pat.loss.dtype == ref.loss.dtype == torch.float32
    assert abs(pat.loss.item() - ref.loss.item()) <= 1e-4
    for k in ref_grads:
        assert compare(pat_grads[k], ref_grads[k])[2], k


def test_verify_passes_with_the_fused_head() -> None:
    model = tiny_for("gemma2")
    engine.apply(model, "gemma2", device="cpu", mode="training", fused_cross_entropy=True)
    assert engine.verify(model).passed


def _emulated_forward(ctx, _input, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
                      label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None,
                      use_token_scaling=False, return_token_accuracy=False, return_predicted_tokens=False,
                      ce_impl=None, ce_mode=None, chunk_mem_const=1):
    """Liger's documented FLCE contract: ``CE(softcap * tanh((x @ W.T) / softcap), target)``, gradients in forward."""
    assert bias is None and ce_weight is None and lse_square_scale == 0.0 and label_smoothing == 0.0
    assert not (return_z_loss or use_token_scaling or return_token_accuracy or return_predicted_tokens)
    with torch.enable_grad():
        h, w = _input.detach().requires_grad_(), weight.detach().requires_grad_()
        logits = torch.nn.functional.linear(h, w).float()
        if softcap is not None:
            logits = softcap * torch.tanh(logits / softcap)
        loss = torch.nn.functional.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
        gh, gw = torch.autograd.grad(loss, (h, w))
    ctx.save_for_backward(gh, gw)
    return loss.detach(), None, None, None


class _EmulatedLigerFLCE(torch.autograd.Function):
    """Torch emulator of the CUDA LigerFusedLinearCrossEntropyFunction (0.8.5 signature)."""

    forward = staticmethod(_emulated_forward)

    @staticmethod
    def backward(ctx, grad, *_):
        gh, gw = ctx.saved_tensors
        return (gh * grad, gw * grad) + (None,) * 16


def _ascend_parameters() -> list[str]:
    """The Ascend backend's FLCE forward parameters, read from the installed source (it imports only on NPU)."""
    spec = importlib.util.find_spec("liger_kernel")
    if spec is None or spec.origin is None:
        pytest.skip("liger-kernel is not installed")
    source = Path(spec.origin).parent / "ops/backends/_ascend/ops/fused_linear_cross_entropy.py"
    if not source.exists():
        pytest.skip("this liger-kernel has no Ascend backend")
    tree = ast.parse(source.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LigerFusedLinearCrossEntropyFunction")
    forward = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward")
    return [a.arg for a in forward.args.args]


def _ascend_emulator() -> type:
    """The emulator with exactly the installed Ascend forward's parameter list (no chunk_mem_const)."""
    names = _ascend_parameters()
    full = inspect.signature(_emulated_forward).parameters
    assert set(names) <= set(full), set(names) - set(full)

    def forward(ctx, *args):
        return _emulated_forward(ctx, *args)

    forward.__signature__ = inspect.Signature([full[n] for n in names])  # type: ignore[attr-defined]
    return type("_EmulatedAscendFLCE", (_EmulatedLigerFLCE,), {"forward": staticmethod(forward)})


@pytest.mark.parametrize("device", ["cuda", "npu"])
@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
@pytest.mark.parametrize("num_items", [None, 29])
def test_liger_mapping_against_emulated_contract(device: str, family: str, num_items: int | None) -> None:
    """The liger kernel, per device's Function, gives the unpatched loss and grads (gemma2: softcap)."""
    function = _EmulatedLigerFLCE if device == "cuda" else _ascend_emulator()
    reference = tiny_for(family)
    patched = copy.deepcopy(reference)
    engine.apply(patched, family, device="cpu", mode="training", fused_cross_entropy=True)
    patch = engine.patching.patcher.applied_report(patched).decisions[-1].patch
    kernel = liger_flce(lambda device_type: function)  # chosen per call, as on a device
    from engine.ops.base import get_op

    patched.forward = get_op("fused_linear_cross_entropy").bind(patched, patch, kernel).__get__(patched)
    batch = _batch(reference)
    extra = {} if num_items is None else {"num_items_in_batch": num_items}
    ref, ref_grads = _run(reference, batch, **extra)
    pat, pat_grads = _run(patched, batch, **extra)
    assert abs(pat.loss.item() - ref.loss.item()) <= 1e-5
    for k in ref_grads:
        assert torch.allclose(pat_grads[k], ref_grads[k], atol=1e-5, rtol=0), k


def test_liger_mapping_matches_installed_signatures() -> None:
    liger = pytest.importorskip("liger_kernel.ops.fused_linear_cross_entropy")
    for forward, names in (
        (liger.LigerFusedLinearCrossEntropyFunction.forward, list(inspect.signature(
            liger.LigerFusedLinearCrossEntropyFunction.forward).parameters)[1:]),
        (_ascend_emulator().forward, _ascend_parameters()[1:]),
    ):
        args = liger_arguments(forward, _input="h", weight="w", target="t", ignore_index=-7, reduction="sum",
                               softcap=30.0)
        bound = dict(zip(names, args, strict=True))
        assert args[:3] == ("h", "w", "t") and bound["reduction"] == "sum" and bound["ignore_index"] == -7
        assert bound["softcap"] == 30.0 and bound["accum_dtype"] is None and bound["label_smoothing"] == 0.0


def test_liger_is_planned_on_npu_and_cuda() -> None:
    from engine.kernels import registry

    provider = registry.get("liger", "fused_linear_cross_entropy")
    assert {d.value for d in provider.devices} == {"cuda", "npu"}
    assert "liger" in registry.AUTO_ORDER[registry.Device.npu]


# -- memory (the allocator's own accounting, through the profiler) ------------------------------


def _peak_rise(fn) -> int:
    """The maximum of the allocator's running total over ``fn``, in bytes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    level = peak = 0
    for _, nbytes in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                            if e.name() == "[memory]"):
        level += nbytes
        peak = max(peak, level)
    return peak


def _matmul_scratch(weight: torch.Tensor, chunk: int) -> int:
    """The most the BLAS allocates for itself in one of the kernel's products, each written into a buffer given."""
    weight, (v, h) = weight.detach(), weight.shape
    grad, rows = torch.ones(chunk, v, dtype=weight.dtype), torch.ones(chunk, h, dtype=weight.dtype)
    out_rows, out_w = torch.empty(chunk, h, dtype=weight.dtype), torch.empty(v, h, dtype=weight.dtype)
    return max(_peak_rise(lambda: torch.mm(grad, weight, out=out_rows)),  # the hidden states' gradient
               _peak_rise(lambda: out_w.addmm_(grad.t(), rows)),  # the weight's, accumulated
               _peak_rise(lambda: torch.mm(rows, weight.t())) - chunk * v * weight.element_size())  # the logits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_memory_one_chunk_at_a_time_and_gradients_in_place(dtype: torch.dtype) -> None:
    """Forward: the head gradient in the weight's dtype plus about one chunk (no fp32 [V, H] in bf16,
    no two chunks alive); backward with grad_output != 1: no second [V, H] buffer."""
    n, h, v, chunk = 256, 256, 8192, 16
    hidden, weight, target = _inputs(dtype, n=n, h=h, v=v)
    elem = torch.finfo(dtype).bits // 8
    grad_w, grad_h, one_chunk = v * h * elem, n * h * elem, chunk * v * (4 + 2 * elem)
    box = {}
    peak = _peak_rise(lambda: box.setdefault("loss", chunked_linear_cross_entropy(hidden, weight, target,
                                                                                  chunk_size=chunk)))
    scratch = _matmul_scratch(weight, chunk)  # the BLAS's own workspace (oneDNN's bf16 on AMX CPUs: ~1 MB here)
    assert peak <= grad_w + 2 * grad_h + 1.5 * one_chunk + scratch, (peak, grad_w, one_chunk, scratch)
    assert peak < grad_w + v * h * 4 or dtype is torch.float32  # no fp32 [V, H] temporary in bf16
    backward_peak = _peak_rise(lambda: (3.0 * box.pop("loss")).backward())
    assert backward_peak < v * h * elem / 4, backward_peak  # scaled in place, handed over as .grad
    assert weight.grad is not None and weight.grad.dtype == dtype


@pytest.mark.parametrize("divisor", [4.0, 0.3])
@pytest.mark.parametrize("softcap", [None, 2.0], ids=["plain", "softcap"])
def test_chunked_kernel_divides_each_chunk_as_the_reference(divisor: float, softcap: float | None) -> None:
    """Granite's ``logits / logits_scaling``: the chunked kernel's loss and both gradients equal the reference."""
    kw = {"softcap": softcap, "chunk_size": 5, "logit_divisor": divisor}
    h, w, t = _inputs()
    ref_loss, *ref_grads = _loss_and_grads(linear_cross_entropy_reference, h, w, t, **kw)
    loss, *grads = _loss_and_grads(chunked_linear_cross_entropy, h, w, t, **kw)
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    undivided, *_ = _loss_and_grads(linear_cross_entropy_reference, h, w, t, softcap=softcap)
    assert abs(undivided.item() - ref_loss.item()) > 1e-3  # the division is not a no-op here


def test_liger_refuses_granites_logit_division_at_plan_time() -> None:
    """Liger's FLCE has no logit division: ``auto`` passes over it on CUDA, an explicit liger is refused."""
    granite = tiny_for("granite", logits_scaling=4.0)
    plan = engine.plan(granite, "granite", device="cuda", mode="training", fused_cross_entropy=True)
    head = [d for d in plan.decisions if d.op == "fused_linear_cross_entropy"]
    assert [d.kernel for d in head] == ["torch"]
    assert "liger" in head[0].reason
    with pytest.raises(engine.PatchError, match="no logit division"):
        engine.plan(granite, "granite", device="cuda", mode="training", fused_cross_entropy={"kernel": "liger"})
    qwen3 = engine.plan(tiny_for("qwen3"), "qwen3", device="cuda", mode="training", fused_cross_entropy=True)
    assert [d.kernel for d in qwen3.decisions if d.op == "fused_linear_cross_entropy"] != [None]
