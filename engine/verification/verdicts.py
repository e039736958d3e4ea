"""Turning the whole-model runs' numbers into checks: the values (logits, loss) and the gradients.

Why apart from :mod:`engine.verification.models`: that module runs the original, the patched
model and the truth and collects numbers; this one holds the rules that judge them (the
per-tensor rule, a low-precision model's population and per-token loss noise, the small
tensors' floor), which tests and benchmarks read on their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine.verification.compare import DTYPE_NAMES, allowed, compare, judge, judge_difference, noise_note
from engine.verification.low_precision import (
    LOW_PRECISION,
    judge_loss,
    judge_population,
    tensor_limit,
    token_loss_noise,
)
from engine.verification.results import MODEL, Check

__all__ = ["SMALL_TENSOR", "Grads", "Seen", "grads_check", "loss_noise", "value_check"]

#: ``(max abs difference, max relative difference, bit-equal)`` of a patched value and the original's.
Seen = tuple[float, float, bool]


@dataclass
class Grads:
    """Per parameter: the difference patched vs original, and the original's error vs fp64."""

    original: dict[str, torch.Tensor] = field(default_factory=dict)
    diff: dict[str, tuple[float, float, bool]] = field(default_factory=dict)
    noise: dict[str, tuple[float, float]] = field(default_factory=dict)  # (max|orig - truth|, max|truth|)
    missing: dict[str, str] = field(default_factory=dict)



def loss_noise(waiting: dict[str, Any], head: str, truth: dict[str, Any], batch: dict[str, Any]) -> float | None:
    """A causal LM's loss noise from the original's and the truth's logits (``token_loss_noise``), or None.

    None (the plain rule) for a base model (no logits, a surrogate loss) or a loss that is not
    transformers' causal-LM cross-entropy. The original and the truth run the unfused head, so this
    holds when the patched model's head is fused too.

    In every dtype, fp32 included: the loss is one scalar, and the original's own error of it is one draw
    that can land arbitrarily close to the truth. Under the conditions of use, fp32 losses whose logits
    and gradients passed at 1.0-1.3x failed at 5.3x and 16x of such a draw (twinkle's emulated RMSNorm on
    llama, mistral and gemma2 with right padding or -100 labels; ``docs/audit.md``). The mean's typical
    error, from the logits' own errors, is the yardstick the bf16 loss already had.
    """
    labels, exact = batch.get("labels"), truth.get(head)
    if head != "logits" or head not in waiting or "loss" not in truth:
        return None
    original = waiting[head][2]
    if original is None or exact is None:
        return None
    if not isinstance(labels, torch.Tensor):  # no token scored (one token, decoding): the logits' mean square
        return surrogate_noise(original, exact)
    items = batch.get("num_items_in_batch")
    items = float(items) if isinstance(items, (int, float, torch.Tensor)) else None
    return token_loss_noise(original, exact, labels, truth["loss"], num_items=items)


def surrogate_noise(original: torch.Tensor, exact: torch.Tensor) -> float:
    """The typical error of the logits' mean square (the loss where no token is scored) from the logits' own errors.

    Why: judged against the original's own error of that one number, which can land arbitrarily close to the truth
    by luck, a label-less loss of a bf16 model failed at 3.8x and 8.7x (OLMo 2 at one token and while decoding)
    while its logits passed at 1.4x; the probe's loss, with labels, allows 6x as much. ``mean(z**2)`` moves by
    ``mean(2 z e)`` for logit errors ``e``: with errors of independent signs, ``sqrt(sum((2 z e)**2)) / N``.
    """
    z = exact.detach().double().to(original.device)
    e = original.detach().double() - z
    return float(torch.sqrt(((2 * z * e) ** 2).sum()) / max(z.numel(), 1))


def value_check(cls: str, what: str, dtype: str, got: torch.Tensor | None, want: torch.Tensor | None, truth: Any,
                typical: float | None = None, seen: Seen | None = None) -> Check:
    """The check of one value (logits, loss): bit-equal, or judged against the truth.

    ``got`` or ``want`` may be None where it was dropped after ``seen`` was taken (the patched
    value where it waits in the model's memory; the original's where no truth runs).
    """
    if want is None or got is None:
        assert seen is not None
        ma, mr, equal = seen
    else:
        (ma, mr, _), equal = compare(got, want), got.dtype == want.dtype and torch.equal(got, want)
    if equal:
        return Check(MODEL, cls, "-", what, dtype, ma, mr, True)
    if truth is None:
        return Check(MODEL, cls, "-", what, dtype, ma, mr, False, "not judged: a gradient is missing")
    assert want is not None  # a truth ran: the original's value was made again for it
    if typical is not None and got is not None and got.shape == want.shape and got.dtype == want.dtype:
        passed, note = judge_loss(got, want, truth, typical)  # a low-precision loss
        return Check(MODEL, cls, "-", what, dtype, ma, mr, passed, note)
    # a low-precision model's logits and loss: two tensors judged as the gradients' population is
    bound = tensor_limit(2) if want.dtype in LOW_PRECISION else 1.0
    verdict = judge(got, want, truth, bound) if got is not None else judge_difference(ma, want, truth, bound)
    passed, note = verdict
    return Check(MODEL, cls, "-", what, dtype, ma, mr, passed, note, limit=getattr(verdict, "limit", None))


#: Gradients of at most this many elements judge their rounding error by the model's typical level too.
SMALL_TENSOR = 4096


def _typical_relative_noise(grads: Grads) -> float:
    """The median over parameters of the original gradient's error relative to its scale.

    Why: every gradient is formed from upstream gradients that carry the whole backward's
    rounding; a tensor's own largest error is the maximum of its elements' errors, and for a
    tensor of a few elements (a per-layer scale, a bias: :data:`SMALL_TENSOR`) that maximum is a
    poor sample and can be luckily tiny. Such a parameter is allowed at least this model-wide
    level times its own scale; large tensors keep their own error, and a wrong declaration
    (orders beyond) exceeds both. Only in fp32: in bf16 and fp16 the floor of one ulp of the
    tensor's scale is already the size of a rounding step, which one ulp of fp32 is not.
    """
    levels = sorted(noise / scale for noise, scale in grads.noise.values() if scale > 0 and math.isfinite(noise))
    return levels[len(levels) // 2] if levels else 0.0


def grads_check(cls: str, dtype: str, grads: Grads, params: dict[str, nn.Parameter]) -> Check:
    """One check for all parameter gradients: the worst parameter's errors, and how many differ.

    A gradient present on one side only (a kernel that detaches, or one that reaches a
    parameter the original does not) is a failure of its own kind, named in the note.
    """
    if grads.missing:
        name = min(grads.missing)
        total = len(grads.diff.keys() | grads.missing.keys())
        note = (f"{len(grads.missing)} of {total} parameter gradients differ; worst: {name} "
                f"({grads.missing[name]})")
        return Check(MODEL, cls, "-", "grads", dtype, float("inf"), float("inf"), False, note)
    if not grads.diff:
        return Check(MODEL, cls, "-", "grads", dtype, 0.0, 0.0, False, "no parameter received a gradient")
    rows = []  # (ratio, name, max abs, max rel, noise)
    level = _typical_relative_noise(grads)
    for name, (ma, mr, ok) in grads.diff.items():
        if ma == 0.0 and ok:
            rows.append((0.0, name, ma, mr, 0.0))
            continue
        noise, scale = grads.noise.get(name, (math.nan, 0.0))  # nan: the truth gave this parameter no gradient
        if params[name].numel() <= SMALL_TENSOR and params[name].dtype in (torch.float32, torch.float64):
            noise = max(noise, level * scale)  # nan stays nan
        limit = 0.0 if math.isnan(noise) else allowed(noise, scale, params[name].dtype)
        rows.append((ma / limit if limit else float("inf"), name, ma, mr, noise))
    failing = [r for r in rows if r[0] > 1.0]
    worst = max(rows, key=lambda r: (r[0], r[2]))
    largest = max(rows, key=lambda r: r[2])
    passed, why = not failing, ""
    if failing and dtype in {DTYPE_NAMES[d] for d in LOW_PRECISION}:  # bf16: a few over is what rounding does
        passed, why = judge_population([r[0] for r in rows])
        why = why or f"within what an equally valid {dtype} run shows"
    if failing:
        note = (f"{len(failing)} of {len(rows)} parameter gradients differ by more than the original's own error "
                f"allows ({why}); worst: {worst[1]}: {noise_note(worst[2], worst[4])}" if why else
                f"{len(failing)} of {len(rows)} parameter gradients differ by more than the original's own error "
                f"allows; worst: {worst[1]}: {noise_note(worst[2], worst[4])}")
    elif largest[2] == 0.0:
        note = f"{len(rows)} parameter gradients; largest difference: none"
    else:
        note = (f"{len(rows)} parameter gradients; largest difference: {largest[1]}; closest to the limit: "
                f"{worst[1]}: {noise_note(worst[2], worst[4])}")
    # the bound beside the largest difference: its own parameter's, where every parameter met its own
    limit = largest[2] / largest[0] if not failing and 0 < largest[0] < float("inf") else None
    return Check(MODEL, cls, "-", "grads", dtype, largest[2], max(r[3] for r in rows), passed, note, limit=limit)
