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
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from engine.errors import InvalidArgument
from engine.patching.patcher import STATE_ATTR, original_forwards
from engine.planning import fused_head
from engine.runtime.hub_functions import torch_path
from engine.runtime.wrappers import unwrap
from engine.verification.compare import DTYPE_NAMES, compare, floating_dtype, max_abs, max_abs_diff
from engine.verification.gradient_hooks import _judge_gradients, _no_checkpointing, _taking_gradients, hold
from engine.verification.results import Check
from engine.verification.routing import RoutingLog, judged_with_routing_pinned, routes
from engine.verification.truth import GradientSink, fp64_truth
from engine.verification.truth_layers import recomputed_layers
from engine.verification.verdicts import Grads, Seen, grads_check, loss_noise, value_check

__all__ = [
    "Alongside", "Offload", "compare_models", "hold", "holding_device", "judging_gradients", "run", "seeded",
    "surrogate_loss", "taking_gradients", "truth_run", "without_labels",
]

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
    if offload == "host":
        return torch.device("cpu")
    return _present_device(offload, device)


def _present_device(offload: Any, model_device: torch.device) -> torch.device:
    """``offload`` as a device of this machine, else :class:`InvalidArgument` naming the setting and what is here.

    A device of the kind the model is on is there by definition (the model's own ``meta``, say).

    Why: torch's own answers (``Expected one of cpu, cuda, ...`` for a typo, ``Torch not compiled
    with CUDA enabled`` for a device this machine lacks) came from deep inside the verification
    and named neither ``offload`` nor what it takes.
    """
    from engine.runtime.devices import as_device, is_present, present_devices

    allowed = "'auto' (default), 'host', 'none', or a device of this machine"
    here = ", ".join(present_devices())
    try:
        target = torch.device(offload)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidArgument(f"verify(offload={offload!r}) is not a place to keep what verification compares: use "
                              f"{allowed} (present: {here})") from None
    if target.type == model_device.type:
        return target
    try:
        present = is_present(as_device(target.type))
    except (InvalidArgument, ValueError):
        present = False
    if not present:
        raise InvalidArgument(f"verify(offload={offload!r}): this machine has no {target.type} device; use {allowed} "
                              f"(present: {here})")
    return target


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


def compare_models(
    patched: nn.Module, batch: dict[str, torch.Tensor], reference: nn.Module | None = None,
    *, offload: Offload = "auto", alongside: Alongside | None = None, scenario: Any = None,
) -> list[Check]:
    """Logits, loss and parameter gradients of ``patched`` vs its original (``reference``, default: itself unpatched).

    ``reference`` is another instance with the same parameters (names and values), for a
    caller that has one; by default the original runs on ``patched``'s own parameters.
    ``offload``: where what waits to be compared is kept (:func:`holding_device`).
    ``alongside``: what the caller runs with the original's and the patched runs (:class:`Alongside`).
    ``scenario``: a condition of use every run goes through (:class:`engine.verification.conditions.Scenario`).
    """
    params = dict(patched.named_parameters())
    every = {id(p): p for m in (patched, reference) if m is not None for p in m.parameters()}
    user_grads = {key: p.grad for key, p in every.items()}  # the caller's, set aside and put back
    for p in every.values():
        p.grad = None
    try:
        held = holding_device(patched, offload)
        checks = _compare(patched, batch, reference, params, held, alongside or Alongside(), scenario)
        if all(c.passed for c in checks) or not routes(reference if reference is not None else patched):
            return checks
        for p in every.values():
            p.grad = None
        log = RoutingLog(getattr(scenario, "compute_dtype", None) or floating_dtype(params.values()))
        return judged_with_routing_pinned(checks, log, lambda: _compare(
            patched, batch, reference, params, held, Alongside(during_original=log.recording,
                                                               during_patched=log.pinning), scenario))
    finally:
        for key, p in every.items():
            p.grad = user_grads[key]


def _compare(
    patched: nn.Module, batch: dict[str, torch.Tensor], reference: nn.Module | None, params: dict[str, nn.Parameter],
    held: torch.device, alongside: Alongside, scenario: Any = None,
) -> list[Check]:
    cls = type(patched).__name__
    grads = Grads()
    ran = reference if reference is not None else patched
    tree = _module_tree(ran)
    with (_original(patched, reference) as original, _taking_gradients(original, grads.original, held),
          alongside.during_original()):
        ref_out = _run(original, batch, scenario=scenario)
    if _module_tree(ran) != tree:  # its forward rebuilt part of the model: run the original again, settled
        del ref_out
        with _original(patched, reference) as original, _taking_gradients(original, grads.original, held):
            ref_out = _run(original, batch, scenario=scenario)
    head = "logits" if "logits" in ref_out else "last_hidden_state"  # a base model has no LM head
    ref = _OriginalOutput(hold(ref_out[head], held), lambda: _original_output(patched, reference, batch, head, held),
                          keep=held != next(patched.parameters()).device or scenario is not None)
    ref_loss, dtype = hold(ref_out["loss"], held), DTYPE_NAMES.get(ref_out[head].dtype, str(ref_out[head].dtype))
    del ref_out
    if not _makes_logits(patched, batch):
        ref.drop()  # a fused head makes no logits in the patched run: not needed before the run after it
    alongside.after_original()
    seen: dict[str, Seen] = {}

    def between(out: Any) -> None:  # the patched logits are there: compare, then drop the original's before the backward
        if out.get(head) is not None:
            seen[head] = _seen(out[head], ref.get())
            ref.drop()

    with _judge_gradients(params, grads), alongside.during_patched():
        pat_out = _run(patched, batch, between=between, scenario=scenario)
    pat_logits, logits_what = pat_out.get(head), head
    if pat_logits is None:  # a fused head + loss does not materialize them: compare the generation path
        pat_logits = without_labels(patched, batch, scenario)["logits"]
        logits_what = "logits (no labels)"
        seen[head] = _seen(pat_logits, ref.get())
    pat_logits, pat_loss = hold(pat_logits, held), hold(pat_out["loss"], held)
    del pat_out
    seen["loss"] = _seen(pat_loss, ref_loss)
    for name in grads.original.keys() - grads.diff.keys():  # the original had one, the patched model not
        grads.missing[name] = "no gradient in the patched model"
    exact = seen[head][2] and seen["loss"][2] and all(d[0] == 0.0 and d[2] for d in grads.diff.values())
    truth_runs = not exact and not grads.missing
    # the values wait here only until judged: the truth judges them after its forward and drops them
    # (and its own fp64 logits) before its backward, the truth's peak
    # on a CPU the patched logits are not kept for that: their difference from the original's is in `seen`
    waiting = {head: (logits_what, pat_logits if ref.keeps else None, ref.get() if truth_runs else ref.value),
               "loss": ("loss", pat_loss, ref_loss)}
    del pat_logits, pat_loss, ref_loss
    ref.value = None  # only `waiting` holds it now: judged and dropped after the truth's forward
    checks: list[Check] = []

    def judge_values(truth: dict[str, Any]) -> None:
        typical = loss_noise(waiting, head, truth, batch)
        for key in list(waiting):
            what, got, want = waiting.pop(key)
            checks.append(value_check(cls, what, dtype, got, want, truth.get(key), typical if key == "loss" else None,
                                      seen[key]))

    rounded: list[str] = []
    if truth_runs:
        with _original(patched, reference) as original:
            rounded = _truth_run(original, batch, head, grads, held, judge_values, scenario=scenario)
    judge_values({})  # bit-equal, or a gradient missing: no truth
    grads.original.clear()
    if scenario is None or scenario.backward:
        checks.append(grads_check(cls, dtype, grads, params))
    if rounded:
        for check in checks:
            check.note += f" (the fp64 truth still rounded in {', '.join(rounded)})"
    return checks


def _module_tree(model: nn.Module) -> list[tuple[str, int]]:
    """Each module's path and identity: what tells that a forward replaced modules of the model.

    Why: a model may rebuild itself in its first forward (BigBird, on a sequence too short for
    block-sparse attention, switches to full attention by building new attention modules), and
    building them draws their initial weights from the global generator after the run's seed:
    that first run draws other dropout masks than every later one, and differs from the patched
    run by those masks, not by the patch. The original then runs again on the settled model
    (its gradients and outputs replace the first run's; the inputs recorded in the first run
    stay, each module check compares both forwards on the same recorded inputs).
    """
    return [(path, id(module)) for path, module in model.named_modules()]


class _OriginalOutput:
    """The original's logits (or last hidden state): held, or dropped while the patched run peaks and recomputed after.

    Why: held through the patched run they sit on top of a training step and the original's
    gradients, the verification's peak ([tokens, vocab]: 160 MiB for Gemma 3 in bf16 at 320
    tokens, 1.2 GiB for Qwen3-8B at 4096). Where they are held on another device (the host, for a
    model on an accelerator) they cost the device nothing and are kept (``keep``); otherwise they
    are dropped once compared with the patched ones and recomputed, by one forward without a graph
    (bit-equal: the same ops on the same inputs, the same dropout draws), only if the truth needs them.
    """

    def __init__(self, value: torch.Tensor, recompute: Callable[[], torch.Tensor], *, keep: bool) -> None:
        self.value: torch.Tensor | None = value
        self._recompute, self.keeps = recompute, keep

    def get(self) -> torch.Tensor:
        if self.value is None:
            self.value = self._recompute()
        return self.value

    def drop(self) -> None:
        if not self.keeps:
            self.value = None


def _original_output(patched: nn.Module, reference: nn.Module | None, batch: dict[str, Any], head: str,
                     held: torch.device) -> torch.Tensor:
    """The original's ``head`` output again: a forward without a graph (and without labels: no loss needed)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with _original(patched, reference) as original, torch.no_grad(), seeded(original):
        if "use_cache" not in inputs and "use_cache" in inspect.signature(original.forward).parameters:
            inputs["use_cache"] = False
        return hold(original(**inputs)[head], held)


def _makes_logits(model: nn.Module, batch: dict[str, Any]) -> bool:
    """Whether the patched run returns the head's output: not where the plan fused the head and the loss
    and the batch has labels (the fused kernel then returns the loss only)."""
    state = unwrap(model).__dict__.get(STATE_ATTR)
    fused = state is not None and any(d.action == "patch" and d.op == fused_head.OP for d in state.report.decisions)
    return not (fused and isinstance(batch.get("labels"), torch.Tensor))


def _seen(got: torch.Tensor, want: torch.Tensor) -> Seen:
    ma, mr, _ = compare(got, want)
    return ma, mr, got.dtype == want.dtype and torch.equal(got, want)


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
         between: Callable[[Any], None] | None = None, scenario: Any = None) -> Any:
    """Forward (inside ``forward_in``, e.g. the fp64 mode) and backward of one batch; ``between(out)`` before the backward.

    ``scenario``: a condition of use (:class:`engine.verification.conditions.Scenario`): what it sets is set around
    the forward and the backward, what precedes the judged call runs before it (outside ``forward_in``), and a
    forward-only condition (autograd off, decoding) has no backward."""
    with seeded(model), torch.enable_grad():  # also when the caller is under torch.no_grad()
        around = scenario.around(model, truth=forward_in is not None) if scenario else contextlib.nullcontext()
        with around:
            if scenario is not None:
                scenario.before(model, batch, truth=forward_in is not None)
            with forward_in if forward_in is not None else contextlib.nullcontext():
                out = scenario.call(model, batch) if scenario is not None else model(**batch)
                if getattr(out, "loss", None) is None and "last_hidden_state" in out:
                    out["loss"] = surrogate_loss(out.last_hidden_state)
                elif getattr(out, "loss", None) is None and getattr(out, "logits", None) is not None:
                    out["loss"] = surrogate_loss(out.logits)  # a head whose forward takes no labels (DiffusionGemma)
            if between is not None:
                between(out)
            if scenario is None or scenario.backward:
                out.loss.backward()
    return out


def without_labels(model: nn.Module, batch: dict[str, Any], scenario: Any = None) -> Any:
    """One forward without labels and without a graph (under ``scenario``): a fused head's logits (it makes none
    where it computes the loss)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with seeded(model), (scenario.around(model, truth=False) if scenario else contextlib.nullcontext()):
        if scenario is not None:
            scenario.before(model, batch)  # an optimizer step's first call has the labels the original's had
        with torch.no_grad():
            return scenario.call(model, inputs) if scenario is not None else model(**inputs)


def surrogate_loss(hidden: torch.Tensor) -> torch.Tensor:
    """The loss of a base model (no LM head): the mean square of its last hidden state, in fp32.

    Why: a text model without a head (Qwen2VLTextModel, ...) returns hidden states, not logits;
    every parameter still gets a gradient through them, so the gradients are compared as for a
    causal LM. A model with a head whose forward takes no labels and returns only logits
    (DiffusionGemma's block diffusion) gets the mean square of its logits, for the same reason.
    """
    return hidden.float().square().mean()


def _truth_run(
    original: nn.Module, batch: dict[str, torch.Tensor], head: str, grads: Grads, held: torch.device,
    judge_values: Callable[[dict[str, Any]], None], *, keep: bool = False, scenario: Any = None,
) -> list[str]:
    """The original in fp64; each parameter's fp64 gradient is measured against the original's as it arrives.

    ``judge_values(truth)`` judges the logits and loss right after the forward, so neither the
    held logits nor the fp64 ones wait through the backward. Returns the calls the truth could
    not widen (it rounded there). ``keep``: the original's gradients stay in ``grads`` once
    measured (an audit runs the truth before the patched model exists), else each is dropped.
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
        if not keep:
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
        out[head] = None  # the fp64 logits: only the loss's backward reads them now ...
        truth.mode.outputs_dropped = True  # ... and may write their gradient into them

    with _no_checkpointing(original), recomputed_layers(original, truth.mode):
        _run(original, batch, forward_in=truth, between=between, scenario=scenario)
    sink.flush()
    # A call the mode could not widen leaves the truth rounded there, like the original: the
    # original's error looks smaller, so the judge is stricter, never laxer. Named, not hidden.
    return sorted(truth.mode.rounded)


#: The runs in the order an audit needs them (the original and its truth before a foreign patch
#: exists, then the patched model): :mod:`engine.auditing.whole_model`.
run, taking_gradients, judging_gradients, truth_run = _run, _taking_gradients, _judge_gradients, _truth_run


def _worst(a: float, b: float) -> float:
    """The larger of two errors, NaN (a non-finite truth) winning."""
    return math.nan if math.isnan(a) or math.isnan(b) else max(a, b)


