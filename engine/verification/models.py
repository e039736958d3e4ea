"""Whole-model checks: logits, loss and every parameter gradient, patched vs unpatched.

A low-precision model that is not bit-equal is judged against the fp32 model instead: it
passes where it is as faithful to the exact computation as transformers' own model is.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from engine.hub_functions import torch_path
from engine.patcher import revert
from engine.verification.compare import DTYPE_NAMES, compare
from engine.verification.results import MODEL, Check


def compare_models(
    patched: nn.Module, batch: dict[str, torch.Tensor], reference: nn.Module | None = None
) -> list[Check]:
    """Logits, loss and parameter gradients of ``patched`` vs ``reference`` (default: its unpatched deep copy)."""
    if reference is None:
        reference = copy.deepcopy(patched)
        revert(reference)
    # The unpatched reference runs transformers' torch functions even where transformers
    # bound them to a package at import (fla on a CPU); no-op otherwise. The patched model
    # runs as it is: if it still reaches fla on a CPU, verification must fail, not hide it.
    with torch_path(reference):
        ref_out = _forward_backward(reference, batch)
    pat_out = _forward_backward(patched, batch)
    cls = type(patched).__name__
    head = "logits" if "logits" in ref_out else "last_hidden_state"  # a base model has no LM head
    dtype = DTYPE_NAMES.get(ref_out[head].dtype, str(ref_out[head].dtype))
    pat_logits, logits_what = pat_out.get(head), head
    if pat_logits is None:  # a fused head + loss does not materialize them: compare the generation path
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        with torch.no_grad():
            pat_logits = patched(**inputs).logits
        logits_what = "logits (no labels)"
    checks = [
        Check(MODEL, cls, "-", what, dtype, *compare(got, want))
        for what, got, want in ((logits_what, pat_logits, ref_out[head]), ("loss", pat_out.loss, ref_out.loss))
    ]
    checks.append(_compare_grads(patched, reference, cls, dtype))
    if ref_out[head].dtype in (torch.bfloat16, torch.float16) and any(c.max_abs != 0.0 for c in checks):
        _judge_against_fp32(checks, patched, reference, batch, pat_logits, pat_out.loss, ref_out)
    patched.zero_grad(set_to_none=True)
    return checks


#: A low-precision patched model passes where it is at most this many times further from the
#: fp32 model than transformers' own low-precision model is.
LOW_PRECISION_FACTOR = 2.0


def _judge_against_fp32(
    checks: list[Check], patched: nn.Module, reference: nn.Module, batch: dict[str, torch.Tensor],
    pat_logits: torch.Tensor, pat_loss: torch.Tensor, ref_out: Any,
) -> None:
    """Judge the whole-model checks of a bf16/fp16 model that is not bit-equal against the fp32 model.

    Why: a fused kernel that rounds once where eager rounds twice is not bit-equal to the
    eager model, and after a few layers no fixed tolerance separates that from a bug. The
    question that matters is whether the patched model is as faithful to the exact (fp32)
    computation as the original low-precision model is. The weights are the same (the fp32
    model is the reference cast up), so the fp32 run is the ground truth both approximate.
    """
    truth = copy.deepcopy(reference).float()
    with torch_path(truth):
        truth_out = _forward_backward(truth, batch)
    head = "logits" if "logits" in ref_out else "last_hidden_state"
    pairs = {checks[0].what: (pat_logits, ref_out[head], truth_out[head]), "loss": (pat_loss, ref_out.loss, truth_out.loss)}
    for check in checks:
        if check.what in pairs:
            got, ref, exact = pairs[check.what]
            ok, note = _as_faithful(got, ref, exact)
        else:  # grads: every parameter
            truth_grads = dict(truth.named_parameters())
            ref_grads = dict(reference.named_parameters())
            verdicts = []
            for name, p in patched.named_parameters():
                if p.grad is None or ref_grads[name].grad is None:
                    continue
                verdicts.append((*_as_faithful(p.grad, ref_grads[name].grad, truth_grads[name].grad), name))
            bad = [v for v in verdicts if not v[0]]
            ok = bool(verdicts) and not bad and "no gradient" not in check.note
            note = f"{len(bad)} of {len(verdicts)} gradients further from fp32 than the original's" if bad else (
                f"every gradient as close to fp32 as the original's (factor {LOW_PRECISION_FACTOR:g})")
        check.passed = ok
        check.note = note


def _as_faithful(got: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor | None) -> tuple[bool, str]:
    if exact is None or got.dtype != ref.dtype:
        return False, "dtype differs" if exact is not None else "no fp32 counterpart"
    e = exact.detach().double()
    err_patched = float((got.detach().double() - e).abs().max())
    err_original = float((ref.detach().double() - e).abs().max())
    scale = float(e.abs().max()) if e.numel() else 0.0
    ok = err_patched <= LOW_PRECISION_FACTOR * err_original + 1e-6 * scale
    return ok, f"vs fp32: patched {err_patched:.2g}, original {err_original:.2g}"


def _forward_backward(model: nn.Module, batch: dict[str, torch.Tensor]) -> Any:
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    if getattr(out, "loss", None) is None and "last_hidden_state" in out:
        out["loss"] = surrogate_loss(out.last_hidden_state)
    out.loss.backward()
    return out


def surrogate_loss(hidden: torch.Tensor) -> torch.Tensor:
    """The loss of a base model (no LM head): the mean square of its last hidden state, in fp32.

    Why: a text model without a head (Qwen2VLTextModel, ...) returns hidden states, not logits;
    every parameter still gets a gradient through them, so the gradients are compared as for a
    causal LM.
    """
    return hidden.float().square().mean()


def _compare_grads(patched: nn.Module, reference: nn.Module, cls: str, dtype: str) -> Check:
    """One check for all parameter gradients: the worst parameter's errors, and how many differ.

    A gradient present on one side only (a kernel that detaches, or one that reaches a
    parameter the original does not) is a failure of its own kind, named in the note.
    """
    ref_params = dict(reference.named_parameters())
    results: list[tuple[float, float, bool, str]] = []
    for name, p in patched.named_parameters():
        mine, theirs = p.grad, ref_params[name].grad
        if mine is None and theirs is None:
            continue
        if mine is None or theirs is None:
            side = "patched" if mine is None else "original"
            results.append((float("inf"), float("inf"), False, f"{name} (no gradient in the {side} model)"))
            continue
        results.append((*compare(mine, theirs), name))
    if not results:
        return Check(MODEL, cls, "-", "grads", dtype, 0.0, 0.0, False, "no parameter received a gradient")
    failing = [r for r in results if not r[2]]
    worst = max(failing or results, key=lambda r: (r[0], r[1]))
    if failing:
        note = f"{len(failing)} of {len(results)} parameter gradients differ; worst: {worst[3]}"
    else:
        note = f"{len(results)} parameter gradients; largest difference: {worst[3] if worst[0] else 'none'}"
    return Check(MODEL, cls, "-", "grads", dtype, worst[0], worst[1], not failing, note)
