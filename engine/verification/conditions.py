"""Conditions of use, as data (``engine/_data/conditions.yaml``): one table for verify, zero configuration and the audit.

Why: every check ran one scenario, 2 sequences of 16 random tokens, no attention mask, no ``-100`` label, one call in
the model's own mode and dtype, no optimizer step, no cache. A norm wrong on its last partial 16-row tile, a mask
rebuilt as if padding were on the right, a loss that scores ``-100`` as token 0, a weight cached at the first call, a
kernel wrong only in eval, under autocast or in fp16: each is exact there and wrong where every user runs it (issue 46).

A :class:`Condition` is a row of the table; a :class:`engine.verification.scenario.Scenario` runs it on one model, for the whole-model runs of
:mod:`engine.verification.models` (``verify``) and :mod:`engine.auditing.whole_model` (the audit), which run the
original, the patched model and the fp64 truth through it and judge them by the probe's rule:

* :meth:`Scenario.around` sets what the condition changes for the run (eval or train mode, the parameters cast to
  bf16 or fp16, autocast, gradient checkpointing, another attention implementation) and puts everything back after the
  backward, bit for bit: parameters, buffers, modes. Autocast and checkpointing are left out of the truth run (the
  truth is the fp64 computation; checkpointing changes memory, not values);
* :meth:`Scenario.before` runs what precedes the judged call, outside the truth: the earlier calls (``repeated calls``)
  and one SGD step (``optimizer step``, its backward :func:`unjudged`);
* :meth:`Scenario.call` is the judged call: padded positions' logits set to 0 in every run (nothing reads them), the
  loss where no token is scored the logits' mean square, decoding with the cache (``generation``: the original's
  greedy tokens fed to every run), forward only where autograd is off;
* :meth:`Scenario.state_check` compares the module buffers after each call (``repeated calls``).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
import yaml
from torch import nn

from engine.verification.probes import probe_batch, takes_labels
from engine.verification.results import Check

__all__ = ["ENV_VAR", "Condition", "budget_seconds", "chosen", "condition_of", "declared", "label_checks",
           "not_applicable", "selection_key", "table", "window"]

#: Which conditions ``engine.verify``, ``apply``'s self-verification and zero configuration run, where set: ``none``,
#: ``all``, ``budget`` or comma-separated names. The suite sets ``none`` (its verify tests judge other things; the
#: conditions' own tests name theirs). Unset: verify runs all that apply, apply and zero configuration the budget's.
ENV_VAR = "PATCH_ENGINE_CONDITIONS"
#: The parameters a condition that copies or casts them may hold in memory once more (elements).
COPY_LIMIT = 600_000_000


@dataclass(frozen=True)
class Condition:
    """One condition of use: a row of ``engine/_data/conditions.yaml`` (its header names the keys)."""

    name: str
    what: str
    catches: str
    length: int | None = None
    size: int = 2
    padding: str | None = None
    padded: int = 0
    ignored: int = 0
    num_items: int = 0
    packed: bool = False
    router_logits: bool = False
    past_window: int | None = None
    mode: str | None = None
    grad: str | None = None
    precision: str | None = None
    calls: int = 1
    step: bool = False
    generate: int = 0
    checkpointing: bool = False
    attention: str | None = None
    cost: float = 1.0
    audit: bool = True

    @property
    def own_batch(self) -> bool:
        """Whether the condition runs a batch of its own (else the probe's, or the batch verify was given)."""
        return self.length is not None or self.past_window is not None

    @property
    def backward(self) -> bool:
        """Whether its judged call has a backward (gradients judged): not with autograd off or while decoding."""
        return self.grad is None and not self.generate


_BATCH_KEYS = {"length", "size", "padding", "padded", "ignored", "num_items", "packed", "router_logits", "past_window"}
_RUN_KEYS = {"mode", "grad", "precision", "calls", "step", "generate", "checkpointing", "attention", "cost", "audit"}


@functools.cache
def _document() -> dict[str, Any]:
    return yaml.safe_load(resources.files("engine").joinpath("_data", "conditions.yaml").read_text(encoding="utf-8"))


@functools.cache
def table() -> tuple[Condition, ...]:
    """Every declared condition, in the table's order (the order a budget takes them in)."""
    out = []
    for entry in _document()["conditions"]:
        batch = dict(entry.get("batch") or {})
        unknown = (set(batch) - _BATCH_KEYS) | (set(entry) - _RUN_KEYS - {"name", "what", "catches", "batch"})
        if unknown:
            raise ValueError(f"engine/_data/conditions.yaml, condition {entry['name']!r}: unknown key(s) "
                             f"{', '.join(sorted(unknown))}")
        out.append(Condition(entry["name"], entry["what"], entry["catches"], **batch,
                             **{k: v for k, v in entry.items() if k in _RUN_KEYS}))
    return tuple(out)


def budget_seconds() -> float:
    """What ``apply``'s self-verification and zero configuration may spend on conditions, on top of the probe."""
    return float(_document().get("budget_s", 2.0))


def declared(names: Iterable[str] | str | None = "all", *, env: str = ENV_VAR) -> list[Condition] | str:
    """The conditions ``names`` asks for: ``"all"``, ``"audit"`` (those marked so), ``"budget"`` (returned as is: the
    caller chooses by time), None or ``()`` (none), or names. ``$PATCH_ENGINE_CONDITIONS`` (``env``), where set,
    replaces ``"all"``, ``"audit"`` and ``"budget"``."""
    rows = table()
    if names in ("all", "audit", "budget") and os.environ.get(env, "").strip():
        wanted = os.environ[env].strip()
        names = None if wanted == "none" else wanted if wanted in ("all", "audit", "budget") else [
            n.strip() for n in wanted.split(",") if n.strip()]
    if names is None:
        return []
    if names == "budget":
        return "budget"
    if names in ("all", "audit"):
        return [c for c in rows if names == "all" or c.audit]
    wanted_names = [names] if isinstance(names, str) else list(names)
    unknown = [n for n in wanted_names if n not in {c.name for c in rows}]
    if unknown:
        raise ValueError(f"no condition {', '.join(map(repr, unknown))}; declared: {', '.join(c.name for c in rows)}")
    return [c for c in rows if c.name in wanted_names]


def selection_key(names: Iterable[str] | str | None) -> str:
    """What ``names`` selects, as a verdict's key holds it: the names (or ``budget``) and the table's digest."""
    wanted = declared(names)
    text = resources.files("engine").joinpath("_data", "conditions.yaml").read_bytes()
    picked = wanted if isinstance(wanted, str) else ",".join(c.name for c in wanted) or "none"
    return f"{picked}@{hashlib.sha256(text).hexdigest()[:16]}"


def chosen(model: nn.Module, names: Iterable[str] | str | None, probe_seconds: float | None = None,
           *, env: str = ENV_VAR) -> tuple[list[Condition], dict[str, str]]:
    """The conditions to run on ``model`` and, for each declared one that will not run, why.

    ``"budget"``: in the table's order, those whose estimated time (``cost`` x ``probe_seconds``, the probe's own
    whole-model check) keeps the total within :func:`budget_seconds`."""
    wanted = declared(names, env=env)
    pool = list(table()) if wanted == "budget" else list(wanted)
    out: list[Condition] = []
    skipped: dict[str, str] = {}
    spent = 0.0
    for c in pool:
        why = not_applicable(model, c)
        if why:
            skipped[c.name] = why
            continue
        if wanted == "budget":
            estimate = c.cost * (probe_seconds or 0.0)
            if spent + estimate > budget_seconds():
                skipped[c.name] = (f"over the {budget_seconds():g} s budget of apply's check (estimated {estimate:.1f} "
                                   "s): engine.verify(model) runs it")
                continue
            spent += estimate
        out.append(c)
    return out, skipped


# -- applicability --------------------------------------------------------------------------------------------------


def _text_config(model: nn.Module) -> Any:
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _parameters(model: nn.Module) -> inspect.Signature:
    return inspect.signature(model.forward)


def _token_lm(model: nn.Module) -> bool:
    """A causal LM on token ids: it takes ``labels`` and its probe is token ids and labels only (no images)."""
    if not takes_labels(model):
        return False
    batch = probe_batch(model, batch=1, seq=2)
    return set(batch) == {"input_ids", "labels"}


def window(model: nn.Module) -> int | None:
    """The model's sliding window or attention chunk, where it has one."""
    text = _text_config(model)
    sizes = [getattr(text, k, None) for k in ("sliding_window", "attention_chunk_size")]
    found = [int(s) for s in sizes if isinstance(s, int) and not isinstance(s, bool) and s > 0]
    return min(found) if found else None


def _numel(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def not_applicable(model: nn.Module, c: Condition) -> str | None:
    """Why ``c`` does not apply to ``model`` (None: it does). Each reason is shown where a report lists conditions."""
    params = _parameters(model).parameters
    kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    if c.own_batch and not _token_lm(model):
        return "its batch is token ids and labels; this model's forward needs more (images) or has no LM head"
    if c.padding and "attention_mask" not in params:
        return "the forward takes no attention_mask"
    if c.num_items and "num_items_in_batch" not in params and not kwargs:
        return "the forward takes no num_items_in_batch"
    if c.packed:
        if "position_ids" not in params:
            return "the forward takes no position_ids"
        rope = getattr(_text_config(model), "rope_parameters", None) or getattr(_text_config(model), "rope_scaling",
                                                                                 None)
        if isinstance(rope, dict) and rope.get("mrope_section"):
            return "its position ids are multimodal (3-D rotary): packing is not a text batch's"
    if c.router_logits and "output_router_logits" not in params:
        return "the model does not route (no output_router_logits)"
    if c.past_window is not None:
        size = window(model)
        if size is None or size > 256:
            return "no sliding window or attention chunk of at most 256 tokens" if size is None else (
                f"its window ({size} tokens) is longer than 256: run verify on a tiny model of its type")
    if c.mode == "eval" and not model.training:
        return "the model is in eval mode: the probe ran it so"
    if c.mode == "train" and model.training:
        return "the model is in train mode: the probe ran it so"
    if c.generate and (not _token_lm(model) or _cache_name(model) is None
                       or getattr(model.config, "is_encoder_decoder", False)):
        return "not a decoder-only causal LM with a KV cache"
    if c.checkpointing and not getattr(model, "supports_gradient_checkpointing", False):
        return "the model does not support gradient checkpointing"
    if c.attention:
        current = getattr(model.config, "_attn_implementation", None)
        if current == c.attention:
            return f"the model runs {c.attention} attention by default: the probe ran it"
        if c.attention == "sdpa" and not getattr(model, "_supports_sdpa", False):
            return "the model does not support sdpa attention"
        if not hasattr(model, "set_attn_implementation"):
            return "the model cannot switch its attention implementation"
    if c.precision in ("bf16", "fp16"):
        dtype = next(model.parameters()).dtype
        if dtype != torch.float32:
            return f"the model is {str(dtype).removeprefix('torch.')} already: the probe ran it so"
    if (c.precision in ("bf16", "fp16") or c.step) and _numel(model) > COPY_LIMIT:
        return (f"it holds the parameters once more ({_numel(model) / 1e9:.1f} B elements): verify a tiny model of "
                "this type for it (engine.verify(tiny, patchset))")
    if c.precision == "autocast" and next(model.parameters()).dtype != torch.float32:
        return "autocast casts fp32 parameters; the model is not fp32"
    return None


def _cache_name(model: nn.Module) -> str | None:
    """The forward's KV-cache argument: ``cache`` (transformers 5.20 on), ``past_key_values`` before; None: none."""
    params = _parameters(model).parameters
    return next((n for n in ("cache", "past_key_values") if n in params), None)


def _vocab(model: nn.Module) -> int:
    return int(getattr(_text_config(model), "vocab_size", 0) or 0)


def label_checks(checks: Sequence[Check], c: Condition) -> list[Check]:
    """A condition's checks named for it: ``logits [left padding]``, the note saying what it is."""
    for check in checks:
        check.what = f"{check.what} [{c.name}]"
        check.note = f"{check.note}; under {c.name}: {c.what}" if check.note else f"under {c.name}: {c.what}"
    return list(checks)


def condition_of(what: str) -> str:
    """``"logits [left padding]"`` -> ``"left padding"``; the probe's own checks -> ``""``."""
    return what[what.rindex("[") + 1:-1] if what.endswith("]") and "[" in what else ""
