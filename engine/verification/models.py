"""Whole-model checks: logits, loss and every parameter gradient, patched vs original.

Three runs of one batch, on the model's own parameters (no copy of the model):

1. the **original**: the patched model with its original forwards and functions
   (:func:`engine.patching.patcher.original_forwards`); its gradients are kept, one set;
2. the **patched** model: each parameter's gradient is compared with the original's as soon
   as autograd has accumulated it, then dropped (a post-accumulate-grad hook), so the patched
   gradients never exist all at once;
3. only if something is not bit-equal, the **truth**: the original evaluated in fp64
   (:mod:`engine.verification.truth`); each parameter's fp64 gradient measures the original's
   own rounding error as it arrives, and the original's gradient is then dropped.

A result passes where it is bit-equal to the original's, or differs from it by at most
``k`` times the original's own rounding error (:func:`engine.verification.compare.judge`).
The user's own ``.grad`` tensors are set aside and put back; dropout draws the same numbers in
every run (one seed, the global RNG state restored after).
"""

from __future__ import annotations

import contextlib
import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from engine.patching.patcher import original_forwards
from engine.runtime.hub_functions import torch_path
from engine.verification.compare import DTYPE_NAMES, allowed, compare, judge, max_abs, max_abs_diff, noise_note
from engine.verification.low_precision import (
    LOW_PRECISION,
    judge_loss,
    judge_population,
    tensor_limit,
    token_loss_noise,
)
from engine.verification.results import MODEL, Check
from engine.verification.truth import GradientSink, fp64_truth
from engine.verification.truth_layers import recomputed_layers

__all__ = ["Alongside", "Offload", "compare_models", "hold", "holding_device", "seeded", "surrogate_loss"]

_SEED = 0x5EED


Offload = Literal["auto", "host", "none"] | str | torch.device | None


def holding_device(model: nn.Module, offload: Offload = "auto") -> torch.device:
    """Where verification keeps what only waits to be compared: the original's gradients, logits and losses.

    ``"auto"`` (the default): the host when the model is on an accelerator, so that the
    device's extra over a training step stays near what one step needs (the original's
    gradients are one more copy of the model's size, which on a GPU the model already
    fills); on a CPU they stay where they are (host and device are one memory).
    ``"host"``: the CPU; ``"none"`` or ``None``: the model's device; a device (``"cuda:1"``): there.
    """
    device = next(model.parameters()).device
    if offload == "auto":
        return torch.device("cpu") if device.type != "cpu" else device
    if offload in ("none", None):
        return device
    return torch.device("cpu" if offload == "host" else offload)


@dataclass
class Alongside:
    """What a caller runs alongside the whole-model check, so that it needs no forward of its own.

    ``during_original()`` and ``during_patched()`` are entered around those runs (e.g. hooks
    recording the inputs each patched module receives); ``after_original()`` runs between them,
    once the original's outputs are held (e.g. the module checks on what was recorded).
    """

    during_original: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    after_original: Callable[[], None] = lambda: None
    during_patched: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext


def hold(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` detached, on ``device`` (no copy where it already is)."""
    return t.detach().to(device)


def compare_models(
    patched: nn.Module, batch: dict[str, torch.Tensor], reference: nn.Module | None = None,
    *, offload: Offload = "auto", alongside: Alongside | None = None,
) -> list[Check]:
    """Logits, loss and parameter gradients of ``patched`` vs its original (``reference``, default: itself unpatched).

    ``reference`` is another instance with the same parameters (names and values), for a
    caller that has one; by default the original runs on ``patched``'s own parameters.
    ``offload``: where what waits to be compared is kept (:func:`holding_device`).
    ``alongside``: what the caller runs with the original's and the patched runs (:class:`Alongside`).
    """
    params = dict(patched.named_parameters())
    every = {id(p): p for m in (patched, reference) if m is not None for p in m.parameters()}
    user_grads = {key: p.grad for key, p in every.items()}  # the caller's, set aside and put back
    for p in every.values():
        p.grad = None
    try:
        return _compare(patched, batch, reference, params, holding_device(patched, offload), alongside or Alongside())
    finally:
        for key, p in every.items():
            p.grad = user_grads[key]


@dataclass
class _Grads:
    """Per parameter: the difference patched vs original, and the original's error vs fp64."""

    original: dict[str, torch.Tensor] = field(default_factory=dict)
    diff: dict[str, tuple[float, float, bool]] = field(default_factory=dict)
    noise: dict[str, tuple[float, float]] = field(default_factory=dict)  # (max|orig - truth|, max|truth|)
    missing: dict[str, str] = field(default_factory=dict)


def _compare(
    patched: nn.Module, batch: dict[str, torch.Tensor], reference: nn.Module | None, params: dict[str, nn.Parameter],
    held: torch.device, alongside: Alongside,
) -> list[Check]:
    cls = type(patched).__name__
    grads = _Grads()
    with (_original(patched, reference) as original, _taking_gradients(original, grads.original, held),
          alongside.during_original()):
        ref_out = _run(original, batch)
    head = "logits" if "logits" in ref_out else "last_hidden_state"  # a base model has no LM head
    ref_logits, ref_loss = hold(ref_out[head], held), hold(ref_out["loss"], held)
    del ref_out
    alongside.after_original()
    with _judge_gradients(params, grads), alongside.during_patched():
        pat_out = _run(patched, batch)
    pat_logits, logits_what = pat_out.get(head), head
    if pat_logits is None:  # a fused head + loss does not materialize them: compare the generation path
        with torch.no_grad(), seeded(patched):
            pat_logits = patched(**{k: v for k, v in batch.items() if k != "labels"}).logits
        logits_what = "logits (no labels)"
    pat_logits, pat_loss = hold(pat_logits, held), hold(pat_out["loss"], held)
    del pat_out
    for name in grads.original.keys() - grads.diff.keys():  # the original had one, the patched model not
        grads.missing[name] = "no gradient in the patched model"
    exact = (torch.equal(pat_logits, ref_logits) and torch.equal(pat_loss, ref_loss)
             and all(d[0] == 0.0 and d[2] for d in grads.diff.values()))
    dtype = DTYPE_NAMES.get(ref_logits.dtype, str(ref_logits.dtype))
    # the values wait here only until judged: the truth judges them after its forward and drops them
    # (and its own fp64 logits) before its backward, the truth's peak
    waiting = {head: (logits_what, pat_logits, ref_logits), "loss": ("loss", pat_loss, ref_loss)}
    del pat_logits, ref_logits, pat_loss, ref_loss
    checks: list[Check] = []

    def judge_values(truth: dict[str, Any]) -> None:
        typical = _loss_noise(waiting, head, truth, batch)
        for key in list(waiting):
            what, got, want = waiting.pop(key)
            checks.append(_value_check(cls, what, dtype, got, want, truth.get(key), typical if key == "loss" else None))

    rounded: list[str] = []
    if not exact and not grads.missing:
        with _original(patched, reference) as original:
            rounded = _truth_run(original, batch, head, grads, held, judge_values)
    judge_values({})  # bit-equal, or a gradient missing: no truth
    grads.original.clear()
    checks.append(_grads_check(cls, dtype, grads, params))
    if rounded:
        for check in checks:
            check.note += f" (the fp64 truth still rounded in {', '.join(rounded)})"
    return checks


@contextlib.contextmanager
def _original(patched: nn.Module, reference: nn.Module | None) -> Iterator[nn.Module]:
    """The original model: ``reference``, or ``patched`` running its original forwards.

    It runs transformers' torch functions even where transformers bound them to a package at
    import (fla on a CPU); the patched model runs as it is: if it still reaches fla on a CPU,
    verification must fail, not hide it.
    """
    with contextlib.ExitStack() as stack:
        model = reference if reference is not None else stack.enter_context(original_forwards(patched))
        stack.enter_context(torch_path(model))
        yield model


@contextlib.contextmanager
def seeded(model: nn.Module) -> Iterator[None]:
    """The same random numbers (dropout) in every run; the caller's RNG state (CPU and the model's device) is restored after."""
    device = next(model.parameters()).device
    devices = [] if device.type == "cpu" else [device.index or 0]
    with torch.random.fork_rng(devices=devices, device_type=device.type if devices else "cuda"):
        torch.manual_seed(_SEED)
        yield


def _run(model: nn.Module, batch: dict[str, torch.Tensor], forward_in: Any = None,
         between: Callable[[Any], None] | None = None) -> Any:
    """Forward (inside ``forward_in``, e.g. the fp64 mode) and backward of one batch; ``between(out)`` before the backward."""
    with seeded(model), torch.enable_grad():  # also when the caller is under torch.no_grad()
        with forward_in if forward_in is not None else contextlib.nullcontext():
            out = model(**batch)
            if getattr(out, "loss", None) is None and "last_hidden_state" in out:
                out["loss"] = surrogate_loss(out.last_hidden_state)
        if between is not None:
            between(out)
        out.loss.backward()
    return out


def surrogate_loss(hidden: torch.Tensor) -> torch.Tensor:
    """The loss of a base model (no LM head): the mean square of its last hidden state, in fp32.

    Why: a text model without a head (Qwen2VLTextModel, ...) returns hidden states, not logits;
    every parameter still gets a gradient through them, so the gradients are compared as for a
    causal LM.
    """
    return hidden.float().square().mean()


@contextlib.contextmanager
def _taking_gradients(model: nn.Module, into: dict[str, torch.Tensor], held: torch.device) -> Iterator[None]:
    """Each gradient of the run, moved out of ``.grad`` into ``into`` (on ``held``) as soon as autograd has accumulated it.

    Why as it arrives, not after the backward: on an accelerator with the gradients held on the
    host, the device then never holds more than the gradients autograd is still forming.
    """

    def take(p: torch.Tensor, name: str) -> None:
        if p.grad is not None:
            into[name] = hold(p.grad, held)
            p.grad = None

    with _on_gradient(dict(model.named_parameters()), take):
        yield


@contextlib.contextmanager
def _judge_gradients(params: dict[str, nn.Parameter], grads: _Grads) -> Iterator[None]:
    """Compare each patched gradient with the original's when autograd has accumulated it, then drop it."""

    def hook(p: torch.Tensor, name: str) -> None:
        mine, theirs = p.grad, grads.original.get(name)
        p.grad = None
        if mine is None:
            return
        if theirs is None:
            grads.missing[name] = "no gradient in the original model"
            return
        grads.diff[name] = compare(mine, theirs)

    with _on_gradient(params, hook):
        yield


@contextlib.contextmanager
def _on_gradient(params: dict[str, nn.Parameter], fn: Callable[[torch.Tensor, str], None]) -> Iterator[None]:
    """``fn(param, name)`` each time autograd has accumulated a gradient of ``params``, while the block runs."""
    handles = [p.register_post_accumulate_grad_hook(lambda p, name=name: fn(p, name))
               for name, p in params.items() if p.requires_grad]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _no_checkpointing(model: nn.Module) -> Iterator[None]:
    """transformers' gradient checkpointing off for the truth run, restored after.

    Why: a checkpointed layer recomputes its forward during backward, outside the fp64 mode, so
    the recomputation would meet fp64 activations with fp32 weights. Checkpointing changes memory,
    not values, so the truth is the same without it.
    """
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    for m in layers:
        m.gradient_checkpointing = False
    try:
        yield
    finally:
        for m in layers:
            m.gradient_checkpointing = True


def _truth_run(
    original: nn.Module, batch: dict[str, torch.Tensor], head: str, grads: _Grads, held: torch.device,
    judge_values: Callable[[dict[str, Any]], None],
) -> list[str]:
    """The original in fp64; each parameter's fp64 gradient is measured against the original's as it arrives.

    ``judge_values(truth)`` judges the logits and loss right after the forward, so neither the
    held logits nor the fp64 ones wait through the backward. Returns the calls the truth could
    not widen (it rounded there).
    """

    def part(name: str, rows: slice | torch.Tensor, exact: torch.Tensor) -> None:
        mine = grads.original.get(name)
        if mine is None:
            return
        if not isinstance(rows, slice):
            mine = mine.index_select(0, rows.to(mine.device))
        elif rows != slice(None):
            mine = mine[rows]
        # on the truth's device: the held gradient comes to it a chunk at a time
        noise = (max_abs_diff(exact, mine), max_abs(exact))
        seen = grads.noise.get(name)
        grads.noise[name] = noise if seen is None else (_worst(seen[0], noise[0]), max(seen[1], noise[1]))

    def done(name: str) -> None:
        grads.original.pop(name, None)

    def arrived(name: str, exact: torch.Tensor) -> None:
        part(name, slice(None), exact)
        done(name)

    sink = GradientSink(arrived, held, on_part=part, on_done=done)
    truth = fp64_truth(original, sink)
    if "use_cache" not in batch and "use_cache" in inspect.signature(original.forward).parameters:
        batch = {**batch, "use_cache": False}  # a cache would be written again when a layer is recomputed
    def between(out: Any) -> None:
        judge_values({head: out[head].detach(), "loss": out["loss"].detach()})
        out[head] = None  # the fp64 logits: nothing else holds them (the loss saved its log-softmax)

    with _no_checkpointing(original), recomputed_layers(original, truth.mode):
        _run(original, batch, forward_in=truth, between=between)
    sink.flush()
    # A call the mode could not widen leaves the truth rounded there, like the original: the
    # original's error looks smaller, so the judge is stricter, never laxer. Named, not hidden.
    return sorted(truth.mode.rounded)


def _worst(a: float, b: float) -> float:
    """The larger of two errors, NaN (a non-finite truth) winning."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


def _loss_noise(waiting: dict[str, Any], head: str, truth: dict[str, Any], batch: dict[str, Any]) -> float | None:
    """A bf16/fp16 causal LM's loss noise from the original's and the truth's logits (``token_loss_noise``), or None.

    None (the plain rule) for fp32, a base model (no logits, a surrogate loss), no labels, or a loss
    that is not transformers' causal-LM cross-entropy. The original and the truth run the unfused
    head, so this holds when the patched model's head is fused too.
    """
    labels, exact = batch.get("labels"), truth.get(head)
    if head != "logits" or head not in waiting or "loss" not in truth or not isinstance(labels, torch.Tensor):
        return None
    original = waiting[head][2]
    if original.dtype not in LOW_PRECISION or exact is None:
        return None
    return token_loss_noise(original, exact, labels, truth["loss"])


def _value_check(cls: str, what: str, dtype: str, got: torch.Tensor, want: torch.Tensor, truth: Any,
                 typical: float | None = None) -> Check:
    ma, mr, _ = compare(got, want)
    if got.dtype == want.dtype and torch.equal(got, want):
        return Check(MODEL, cls, "-", what, dtype, ma, mr, True)
    if truth is None:
        return Check(MODEL, cls, "-", what, dtype, ma, mr, False, "not judged: a gradient is missing")
    if typical is not None and got.shape == want.shape and got.dtype == want.dtype:  # a low-precision loss
        passed, note = judge_loss(got, want, truth, typical)
        return Check(MODEL, cls, "-", what, dtype, ma, mr, passed, note)
    # a low-precision model's logits and loss: two tensors judged as the gradients' population is
    passed, note = judge(got, want, truth, tensor_limit(2) if want.dtype in LOW_PRECISION else 1.0)
    return Check(MODEL, cls, "-", what, dtype, ma, mr, passed, note)


#: Gradients of at most this many elements judge their rounding error by the model's typical level too.
SMALL_TENSOR = 4096


def _typical_relative_noise(grads: _Grads) -> float:
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


def _grads_check(cls: str, dtype: str, grads: _Grads, params: dict[str, nn.Parameter]) -> Check:
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
    return Check(MODEL, cls, "-", "grads", dtype, largest[2], max(r[3] for r in rows), passed, note)
