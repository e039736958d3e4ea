"""A condition of use run on one model (:class:`Scenario`), for the whole-model runs of ``verify`` and the audit.

:mod:`engine.verification.models` (``verify``) and :mod:`engine.auditing.whole_model` (the audit) run the original,
the patched model and the fp64 truth through it and judge them by the probe's rule:

* :meth:`Scenario.around` sets what the condition changes for the run (eval or train mode, the parameters cast to
  bf16 or fp16, autocast, gradient checkpointing, another attention implementation: :mod:`engine.verification.
  run_settings`) and puts everything back after the backward, bit for bit. Checkpointing is left out of the truth
  run (it changes memory, not values); autocast is not (it casts no fp64 tensor, and a module that asks whether it
  is on computes the same function in the truth as in the run);
* :meth:`Scenario.before` runs what precedes the judged call, outside the truth mode: the earlier calls
  (``repeated calls``) and one SGD step (``optimizer step``, its backward :func:`unjudged`; the truth takes the
  original's stepped parameters);
* :meth:`Scenario.call` is the judged call: padded positions' logits set to 0 in every run (nothing reads them), the
  loss where no token is scored the logits' mean square, decoding with the cache (``generation``: the original's
  greedy tokens fed to every run), forward only where autograd is off;
* :meth:`Scenario.state_check` compares the module buffers after each call (``repeated calls``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from engine.verification import run_settings
from engine.verification.conditions import Condition, _cache_name, _parameters, _text_config, _vocab, window
from engine.verification.gradient_hooks import unjudged
from engine.verification.models import surrogate_loss
from engine.verification.probes import probe_batch
from engine.verification.results import MODEL, Check

__all__ = ["STEP", "Scenario"]

#: The largest step an ``optimizer step`` condition moves a parameter by (the largest gradient's entry's step).
STEP = 1e-2


class Scenario:
    """One condition, run on one model by the whole-model checks (original, patched, truth: see the module docs)."""

    def __init__(self, condition: Condition):
        self.condition = condition
        self.tokens: torch.Tensor | None = None  # generation: the original's greedy tokens, fed to every later run
        self.states: list[list[dict[str, torch.Tensor]]] = []  # repeated calls: per run, the buffers changed per call
        self._start: dict[str, torch.Tensor] = {}
        self.stepped: list[torch.Tensor] | None = None  # optimizer step: the original's parameters after its step
        self.update: list[torch.Tensor | None] | None = None  # ... and its step, which every later run takes
        self._recording = False

    @property
    def backward(self) -> bool:
        return self.condition.backward

    @property
    def compute_dtype(self) -> torch.dtype | None:
        """The dtype the condition computes in where it is not the parameters' own (bf16 under autocast and the
        bf16 cast, fp16 under the fp16 cast): what a router's tie is measured in."""
        return {"autocast": torch.bfloat16, "bf16": torch.bfloat16, "fp16": torch.float16}.get(
            self.condition.precision or "")

    # the batch

    def batch(self, model: nn.Module, given: dict[str, Any]) -> dict[str, Any]:
        """The condition's batch: its own (token ids of its length, mask, labels, extra inputs), else ``given``."""
        c = self.condition
        if not c.own_batch:
            return dict(given)
        length = c.length if c.length is not None else (window(model) or 0) + (c.past_window or 0)
        made = probe_batch(model, batch=c.size, seq=length, seed=1)
        ids, labels = made["input_ids"], made["labels"]
        out: dict[str, Any] = {"input_ids": ids}
        if c.padding:
            mask = torch.ones_like(ids)
            pad = slice(0, c.padded) if c.padding == "left" else slice(length - c.padded, None)
            mask[0, pad] = 0
            pad_id = getattr(_text_config(model), "pad_token_id", None)
            ids[0, pad] = pad_id if isinstance(pad_id, int) and 0 <= pad_id < _vocab(model) else 0
            labels = ids.masked_fill(mask == 0, -100)
            out["attention_mask"] = mask
        if c.ignored:
            labels[-1, :c.ignored] = -100
        if length > 1:
            out["labels"] = labels
        if c.num_items:
            scored = int((labels[..., 1:] != -100).sum())
            out["num_items_in_batch"] = torch.tensor(c.num_items * scored, device=ids.device)
        if c.packed:
            first = min(10, length - 1)
            row = torch.cat([torch.arange(first), torch.arange(length - first)]).to(ids.device)
            out["position_ids"] = row[None].expand(ids.shape[0], -1).clone()
        if c.router_logits:
            out["output_router_logits"] = True
        if "use_cache" in _parameters(model).parameters:
            out["use_cache"] = False
        return out

    # the run

    @contextlib.contextmanager
    def around(self, model: nn.Module, *, truth: bool) -> Iterator[None]:
        """What the condition changes for one run (its forward and backward), put back after it bit for bit."""
        c = self.condition
        with contextlib.ExitStack() as stack:
            stack.enter_context(run_settings.buffers_kept(model))
            if c.step:
                stack.enter_context(run_settings.parameters_kept(model))
            if c.mode or c.checkpointing or c.generate:
                stack.enter_context(run_settings.mode(model, training=c.mode == "train" or c.checkpointing))
            if c.precision in ("bf16", "fp16"):
                stack.enter_context(run_settings.cast(model, torch.bfloat16 if c.precision == "bf16" else torch.float16))
            # autocast in the truth too: it casts no fp64 tensor, so the truth stays fp64, and a module that asks
            # whether autocast is on (an upcast it does under autocast) computes the same function as in the run
            if c.precision == "autocast":
                device = next(model.parameters()).device.type
                stack.enter_context(torch.autocast(device_type=device, dtype=torch.bfloat16))
            if c.checkpointing and not truth:
                stack.enter_context(run_settings.checkpointing(model))
            if c.attention:
                stack.enter_context(run_settings.attention(model, c.attention))
            self._recording = c.calls > 1 and not truth
            if self._recording:
                self._start = _buffers(model, clone=True)
                self.states.append([])
            yield

    def before(self, model: nn.Module, batch: dict[str, Any], *, truth: bool = False) -> None:
        """What precedes the judged call, outside the truth mode: the earlier calls, one optimizer step.

        The step is the original's in every run: its parameters after the step, recorded in the original's run (the
        first), are the truth's (the truth run's backward goes to its fp64 sink, and its layers recompute in the fp64
        mode: a step there would move other parameters by other amounts); the patched model runs its first call and
        backward (a weight cached there, a hook that edits a weight after its gradient, act as in training) and
        then takes the original's step, so that its own rounding in that backward is not carried into the judged
        call (it would be judged twice, and a router's near-tie could flip on it)."""
        c = self.condition
        for _ in range(c.calls - 1):
            with torch.no_grad():
                model(**batch)
            self._record(model)
        if c.step and truth and self.stepped is not None:
            with torch.no_grad():
                for p, value in zip(model.parameters(), self.stepped, strict=True):
                    p.copy_(value)
            return
        if c.step:
            with torch.enable_grad():
                out = model(**batch)
                loss = _loss(out)
                with unjudged():
                    loss.backward()
            del out, loss
            params = list(model.parameters())
            with torch.no_grad():
                if self.update is None:  # the original's run: its step is every later run's
                    top = max((float(p.grad.abs().max()) for p in params if p.grad is not None), default=0.0)
                    scale = -STEP / top if top > 0 and math.isfinite(top) else 0.0
                    self.update = [None if p.grad is None else p.grad.to(p.dtype) * scale for p in params]
                for p, step in zip(params, self.update, strict=True):
                    if step is not None:
                        p.add_(step)
                    p.grad = None
            if self.stepped is None:
                self.stepped = [p.detach().clone() for p in params]

    def call(self, model: nn.Module, batch: dict[str, Any]) -> Any:
        """The judged call; its output has the head's output (``logits``) and ``loss``."""
        c = self.condition
        if c.generate:
            return self._generate(model, batch)
        quiet = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}.get(c.grad or "",
                                                                                       contextlib.nullcontext)
        with quiet():
            out = model(**batch)
            mask = batch.get("attention_mask")
            head = "logits" if "logits" in out else "last_hidden_state"
            made = out.get(head)  # None: a fused head with labels makes the loss alone
            if isinstance(mask, torch.Tensor) and made is not None and c.padding:
                out[head] = made = made * mask[..., None].to(made.dtype)
            if getattr(out, "loss", None) is None and made is not None:
                out["loss"] = surrogate_loss(made)
            if c.grad == "inference_mode":  # plain tensors: the judge holds and compares them outside the mode
                for key in (head, "loss"):
                    if out.get(key) is not None:
                        out[key] = out[key].clone()
        if c.calls > 1:
            self._record(model)
        return out

    def _generate(self, model: nn.Module, batch: dict[str, Any]) -> Any:
        from transformers.modeling_outputs import CausalLMOutput

        ids, name = batch["input_ids"], _cache_name(model) or "past_key_values"
        steps, fed = [], []
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
            cache = out[name]
            steps.append(out.logits[:, -1])
            for i in range(self.condition.generate):
                token = self.tokens[:, i] if self.tokens is not None else steps[-1].argmax(-1)
                fed.append(token)
                out = model(input_ids=token[:, None], use_cache=True, **{name: cache})
                cache = out[name]
                steps.append(out.logits[:, -1])
            if self.tokens is None:  # the first run is the original's: its tokens are every run's
                self.tokens = torch.stack(fed, 1)
            logits = torch.stack(steps, 1)
        return CausalLMOutput(loss=surrogate_loss(logits), logits=logits)

    def _record(self, model: nn.Module) -> None:
        if not self._recording:
            return
        now = _buffers(model, clone=False)
        self.states[-1].append({k: v.detach().clone() for k, v in now.items()
                                if k not in self._start or not _same(v, self._start[k])})

    def state_check(self, cls: str) -> Check | None:
        """The buffers after each call, the patched run's against the original's (the first run recorded)."""
        if self.condition.calls <= 1 or len(self.states) < 2:
            return None
        original, patched = self.states[0], self.states[-1]
        worst, where = 0.0, ""
        for call, (mine, theirs) in enumerate(zip(patched, original, strict=False), 1):
            for name in sorted(mine.keys() | theirs.keys()):
                if name not in mine or name not in theirs:
                    side = "original" if name in theirs else "patched model"
                    return Check(MODEL, cls, "-", "state", "-", float("inf"), float("inf"), False,
                                 f"buffer {name} changed at call {call} in the {side} only")
                a, b = mine[name].double(), theirs[name].double()
                if a.shape != b.shape:
                    return Check(MODEL, cls, "-", "state", "-", float("inf"), float("inf"), False,
                                 f"buffer {name} has shape {tuple(a.shape)} after call {call}, the original's "
                                 f"{tuple(b.shape)}")
                diff = float((a - b).abs().max()) if a.numel() else 0.0
                scale = float(b.abs().max()) if b.numel() else 0.0
                if diff > 1e-4 * max(scale, 1.0) and diff > worst:
                    worst, where = diff, f"buffer {name} after call {call}"
        if worst:
            return Check(MODEL, cls, "-", "state", "-", worst, worst, False, f"{where} differs from the original's")
        changed = sum(len(s) for s in original)
        return Check(MODEL, cls, "-", "state", "-", 0.0, 0.0, True,
                     f"module buffers after each of {self.condition.calls} calls: the original's"
                     + (f" ({changed} changed)" if changed else " (none changed)"))


def _loss(out: Any) -> torch.Tensor:
    loss = getattr(out, "loss", None)
    if loss is not None:
        return loss
    return surrogate_loss(out["logits"] if "logits" in out else out["last_hidden_state"])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b))


def _buffers(model: nn.Module, *, clone: bool) -> dict[str, torch.Tensor]:
    """Every buffer by name (cloned: a snapshot the calls cannot change)."""
    return {name: (b.detach().clone() if clone else b) for name, b in model.named_buffers()
            if isinstance(b, torch.Tensor)}
