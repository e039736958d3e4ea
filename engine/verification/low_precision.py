"""The whole-model judge for bf16 and fp16 models: how many tensors may exceed the per-tensor rule, and by how much.

Why its own rule: the per-tensor rule (``max|patched - original| <= k x max|original - fp64|
+ 1 ulp``, :func:`engine.verification.compare.allowed`) compares with *one* sample of a random
rounding error. In fp32 that sample is stable; in bf16 a deep model's gradients carry their
forward's roundings through every layer (about 5% of each gradient, RMS), and the largest
element error of one tensor is one draw of a heavy-tailed ratio: the unpatched original,
re-run with its input embeddings nudged by one bf16 ulp (an equally valid run), exceeds the
k = 3 rule on 2-4% of the gradients of both real checkpoints, up to ~3x past it
(``benchmarks/results/verify_bf16.md``). Requiring every one of ~270 tensors to pass fails
correct kernels routinely.

The statistical ground. Under the hypothesis that the patched model is an equally valid run,
each tensor's ratio ``r = diff / allowed`` exceeds 1 with probability :data:`P_OVER`, and its
tail falls as ``P(r > x) = P_OVER * x**-TAIL_INDEX`` (both measured on equally valid runs of
the two real checkpoints). For ``n`` judged tensors and a false-failure probability
:data:`ALPHA` for each of the two tests:

* **per tensor**: each ``r`` at most :func:`tensor_limit` ``(n) = (P_OVER * n / ALPHA) **
  (1 / TAIL_INDEX)`` (a union bound over the ``n`` tensors): a single tensor far off fails;
* **population**: the number of tensors with ``r > 1`` at most :func:`count_limit` ``(n)``,
  the smallest ``c`` with ``P(Binomial(n, P_OVER) > c) <= ALPHA``: an error that shifts many
  tensors a little (a backward 1% off that every layer's gradient carries) fails though no
  tensor alone is improbable.

The loss (:func:`judge_loss`) is one scalar, not a population: a mean over the batch's ``N``
tokens of per-token cross-entropies, each carrying its own bf16 rounding error ``e_i`` (1e-3 to
1e-2). The original's distance from fp64 is *one* draw of the mean of those errors, sometimes
far below its typical size ``sqrt(sum e_i**2) / N`` (SmolLM2 bf16: 7.4e-5 where the typical size
is several times that). So the loss's noise is ``max(own error, sqrt(sum e_i**2) / N)``, the
``e_i`` measured in fp64 from the original's and the truth's logits the verification already holds.

fp32 (and fp64) models keep the per-tensor rule unchanged: there every tensor must pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from engine.verification.compare import FLOOR_ULPS, max_abs, max_abs_diff, noise_note, ulp

__all__ = ["ALPHA", "LOSS_NOISE_FACTOR", "LOW_PRECISION", "P_OVER", "TAIL_INDEX", "count_limit", "judge_loss",
           "judge_population", "tensor_limit", "token_loss_noise"]

#: Model dtypes judged by this rule (the others by the per-tensor rule).
LOW_PRECISION = (torch.bfloat16, torch.float16)

#: The share of tensors over the per-tensor rule in an equally valid bf16 run (``r > 1``): measured 71 of
#: 1524 (0.047; SmolLM2 0.029, Gemma 3 0.064) over three nudged runs of each real checkpoint, rounded up.
P_OVER = 0.05

#: The tail index of ``r`` beyond 1 in equally valid runs: the Hill estimator over the 40 largest of
#: those 1524 ratios gives 3.2 (SmolLM2 alone 2.6), rounded down (a heavier tail: a laxer cap).
TAIL_INDEX = 3.0

#: The false-failure probability allowed to each of the two tests (per tensor, population) of one verification.
ALPHA = 0.01


def tensor_limit(n: int) -> float:
    """The largest ``diff / allowed`` one of ``n`` tensors may reach (at least 1: the per-tensor rule)."""
    return max(1.0, (P_OVER * max(n, 1) / ALPHA) ** (1.0 / TAIL_INDEX))


def count_limit(n: int) -> int:
    """The most of ``n`` tensors that may exceed the per-tensor rule: ``P(Binomial(n, P_OVER) > limit) <= ALPHA``."""
    p, total, c = P_OVER, 0.0, 0
    while c <= n:
        total += math.comb(n, c) * p**c * (1 - p) ** (n - c)
        if 1.0 - total <= ALPHA:
            return c
        c += 1
    return n


def judge_population(ratios: Sequence[float]) -> tuple[bool, str]:
    """Whether ``ratios`` (each tensor's ``diff / allowed``) pass both tests; ``(passed, why not)``."""
    n = len(ratios)
    worst, over = max(ratios, default=0.0), sum(r > 1.0 for r in ratios)
    cap, most = tensor_limit(n), count_limit(n)
    if worst > cap:
        return False, f"a tensor at {worst:.3g}x its limit, past the {cap:.3g}x that {n} equally valid tensors reach"
    if over > most:
        return False, f"{over} of {n} over their limit, more than the {most} an equally valid low-precision run reaches"
    return True, ""


#: ``k`` for the loss: it passes within ``k x max(own error, sqrt(sum e_i**2) / N) + 1 ulp`` of the
#: original. Ground: the loss is the mean of ``N`` (hundreds of) independent per-token rounding
#: errors, so by the central limit theorem each valid run's loss error is ~Normal with standard
#: deviation ``sigma = sqrt(sum e_i**2) / N``; a patched run is another such sample, whose rounding may
#: be up to 2x the original's (the per-tensor rule's allowance, ``NOISE_FACTOR`` = 3), so
#: ``patched - original`` has standard deviation up to ``sqrt(1 + 2**2) sigma = 2.24 sigma``; a two-sided
#: false-failure probability of :data:`ALPHA` (z = 2.576) needs ``k >= 5.76``: 6.
LOSS_NOISE_FACTOR = 6.0

#: Elements (fp64) of one block of logits when the per-token errors are measured: two such blocks at a time.
_BLOCK = 1 << 21


def token_loss_noise(logits: torch.Tensor, exact: torch.Tensor, labels: torch.Tensor, exact_loss: torch.Tensor,
                     ignore_index: int = -100, num_items: float | None = None) -> float | None:
    """``sqrt(sum e_i**2) / N``: the typical size of the mean of the per-token loss errors, or ``None``.

    ``e_i = CE_i(logits) - CE_i(exact)`` in fp64, with transformers' causal-LM loss (``ForCausalLMLoss``:
    position ``t`` predicts ``labels[t + 1]``, ``ignore_index`` skipped, the mean over the ``N`` valid
    tokens). ``logits`` are the original's (held, maybe on the host), ``exact`` the truth's fp64 ones.
    Blockwise over tokens: never more than two ``_BLOCK``-sized fp64 blocks beside the held logits.
    ``None`` where this is not the model's loss (the truth's loss is not the mean of its per-token
    cross-entropies, e.g. a model with another loss): the caller keeps the plain rule there.
    ``num_items``: the batch's ``num_items_in_batch`` (gradient accumulation): transformers then divides
    the sum by it, not by ``N``, and so does this (without it, such a loss kept the one-draw rule and
    failed correct bf16 kernels at 54x).
    """
    if logits.dim() != 3 or logits.shape != exact.shape or labels.shape != logits.shape[:2]:
        return None
    vocab, device = logits.shape[-1], exact.device
    target = labels.to(device)[:, 1:]  # position t predicts label t + 1 (transformers pads the shifted end)
    valid = target != ignore_index
    n = int(valid.sum())
    if n == 0:
        return None
    step = max(1, _BLOCK // max(1, vocab))
    squares = exact_sum = 0.0
    for b in range(target.shape[0]):  # views of one sequence's rows: no copy of the whole logits
        for s in range(0, target.shape[1], step):
            e = min(s + step, target.shape[1])
            ok = valid[b, s:e]
            safe = target[b, s:e].masked_fill(~ok, 0).unsqueeze(1)
            losses = []
            for x in (logits[b, s:e].to(device=device, dtype=torch.float64), exact[b, s:e].detach().to(torch.float64)):
                losses.append((torch.logsumexp(x, dim=-1) - x.gather(1, safe).squeeze(1)).masked_fill(~ok, 0.0))
                del x
            squares += float((losses[0] - losses[1]).square().sum())
            exact_sum += float(losses[1].sum())
    truth_loss = float(exact_loss)
    divisor = float(num_items) if num_items else float(n)
    if not math.isfinite(truth_loss) or abs(exact_sum / divisor - truth_loss) > 1e-9 * max(1.0, abs(truth_loss)):
        return None  # not the causal-LM cross-entropy transformers takes: no claim about its noise
    return math.sqrt(squares) / divisor


def judge_loss(got: torch.Tensor, original: torch.Tensor, truth: torch.Tensor, typical: float) -> tuple[bool, str]:
    """Whether the patched loss is within :data:`LOSS_NOISE_FACTOR` x its noise of the original's; ``(passed, note)``.

    The noise is ``max(|original - truth|, typical)``, ``typical`` from :func:`token_loss_noise`.
    """
    diff, own = max_abs_diff(got, original), max_abs_diff(original, truth)
    noise = max(own, typical)
    limit = LOSS_NOISE_FACTOR * noise + FLOOR_ULPS * ulp(max_abs(truth), original.dtype)
    note = noise_note(diff, own, max_abs_diff(got, truth))
    note += f"; the mean's typical error sqrt(sum e_i^2)/N {typical:.2g}: limit {limit:.2g}"
    return diff <= limit, note
