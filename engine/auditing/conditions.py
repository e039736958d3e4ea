"""Conditions of use, as data (``engine/_data/conditions.yaml``), judged by the audit's whole-model check.

Why: every check an audit ran was one scenario, 2 sequences of 16 random tokens with no attention mask and no
``-100`` label. A norm wrong on its last partial 16-row tile, a mask rebuilt as if padding were on the right, a loss
that scores ``-100`` as token 0: each is exact there and wrong where every user runs it (issue 46). Each condition
here is a batch the probe is not: other lengths, left and right padding, ignored labels. Its original is measured
with the rest of the original (logits, loss, every gradient, the fp64 truth), before any patch exists, and the
patched copy is judged under it by the same rule (:mod:`engine.auditing.whole_model`); its checks are the probe's,
labelled with the condition (``logits [left padding]``), so every locator and the verdict treat them alike.

Two things make a condition's numbers mean what a user sees: padded positions' logits are not compared (set to 0 in
both runs; nothing reads them, and their labels are ``-100``), and where no token is scored (one token per
sequence) the loss is the logits' mean square, so the gradients are still judged.
"""

from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
import yaml
from torch import nn

from engine.auditing.whole_model import OriginalRun, judge_patched, measure_original
from engine.verification.models import surrogate_loss
from engine.verification.probes import probe_batch, takes_labels
from engine.verification.results import Check

__all__ = ["Condition", "Measured", "conditions", "judge_conditions", "measure_conditions"]


@dataclass(frozen=True)
class Condition:
    """One condition of use: a batch the probe is not (see the YAML's header for the keys)."""

    name: str
    what: str
    catches: str
    length: int
    padding: str | None = None
    padded: int = 0
    ignored: int = 0
    cost: int = 1
    default: bool = True


@functools.cache
def _table() -> tuple[Condition, ...]:
    text = resources.files("engine").joinpath("_data", "conditions.yaml").read_text(encoding="utf-8")
    out = []
    for entry in yaml.safe_load(text)["conditions"]:
        batch = entry["batch"]
        out.append(Condition(entry["name"], entry["what"], entry["catches"], int(batch["length"]),
                             batch.get("padding"), int(batch.get("padded", 0)), int(batch.get("ignored", 0)),
                             int(entry.get("cost", 1)), bool(entry.get("default", True))))
    return tuple(out)


#: What ``"default"`` means where set: ``none``, ``all``, or comma-separated names. The suite sets ``none`` (its
#: audit tests judge other things, and each condition costs a run of the model per patch); the conditions' own
#: tests name theirs. Unset: the conditions marked default in conditions.yaml.
DEFAULT_ENV_VAR = "PATCH_ENGINE_AUDIT_CONDITIONS"


def conditions(names: Iterable[str] | str | None = "default") -> list[Condition]:
    """The declared conditions: ``"default"`` (those marked so, or ``$PATCH_ENGINE_AUDIT_CONDITIONS``), ``"all"``,
    None or ``()`` (none), or names."""
    table = _table()
    if names == "default" and os.environ.get(DEFAULT_ENV_VAR, "").strip():
        chosen = os.environ[DEFAULT_ENV_VAR].strip()
        names = None if chosen == "none" else "all" if chosen == "all" else [n.strip() for n in chosen.split(",")]
    if names is None:
        return []
    if names in ("default", "all"):
        return [c for c in table if names == "all" or c.default]
    wanted = list(names)
    unknown = [n for n in wanted if n not in {c.name for c in table}]
    if unknown:
        raise ValueError(f"no condition {', '.join(map(repr, unknown))}; declared: {', '.join(c.name for c in table)}")
    return [c for c in table if c.name in wanted]


def applies(model: nn.Module) -> bool:
    """A causal LM on token ids (a model that takes ``labels`` and ``input_ids``, no images to place)."""
    batch = probe_batch(model, batch=2, seq=2)
    return takes_labels(model) and set(batch) == {"input_ids", "labels"}


def condition_batch(model: nn.Module, condition: Condition) -> dict[str, Any]:
    """The condition's batch: token ids of its length, its attention mask and its labels."""
    batch = probe_batch(model, batch=2, seq=condition.length, seed=1)
    ids, labels = batch["input_ids"], batch["labels"]
    out: dict[str, Any] = {"input_ids": ids}
    if condition.padding:
        mask = torch.ones_like(ids)
        pad = slice(0, condition.padded) if condition.padding == "left" else slice(condition.length - condition.padded,
                                                                                  None)
        mask[0, pad] = 0
        pad_id = getattr(model.config, "pad_token_id", None)
        ids[0, pad] = pad_id if isinstance(pad_id, int) and pad_id >= 0 else 0
        labels = ids.masked_fill(mask == 0, -100)
        out["attention_mask"] = mask
    if condition.ignored:
        labels[1, :condition.ignored] = -100
    if condition.length > 1:
        out["labels"] = labels
    if "use_cache" in inspect.signature(model.forward).parameters:
        out["use_cache"] = False
    return out


class _Under(nn.Module):
    """The model as a condition judges it: padded positions' logits set to 0 (nothing reads them), and where no
    label is given (one token: nothing to score), the logits' mean square as the loss."""

    def __init__(self, model: nn.Module, mask: torch.Tensor | None):
        super().__init__()
        self.model = model
        self.mask = mask

    def forward(self, **batch: Any) -> Any:
        out = self.model(**batch)
        if self.mask is not None:
            out["logits"] = out["logits"] * self.mask[..., None].to(out["logits"].dtype)
        if getattr(out, "loss", None) is None:
            out["loss"] = surrogate_loss(out["logits"])
        return out


@dataclass
class Measured:
    """A condition, its batch and the original's numbers under it."""

    condition: Condition
    batch: dict[str, Any]
    original: OriginalRun


def measure_conditions(model: nn.Module, held: torch.device, wanted: Sequence[Condition]) -> list[Measured]:
    """The original under each condition (before any patch exists), as the probe's original is measured."""
    if not wanted or not applies(model):
        return []
    out = []
    for condition in wanted:
        batch = condition_batch(model, condition)
        out.append(Measured(condition, batch, measure_original(_under(model, batch), batch, held)))
    return out


def _under(model: nn.Module, batch: dict[str, Any]) -> nn.Module:
    return _Under(model, batch.get("attention_mask"))


def judge_conditions(patched: nn.Module, measured: Sequence[Measured], held: torch.device,
                     only: set[str] | None = None, previous: Sequence[Check] = ()) -> list[Check]:
    """The patched copy under each condition, its checks labelled ``what [condition]``; a condition not in ``only``
    keeps its ``previous`` checks (a rerun judges again only the conditions whose numbers moved)."""
    kept: dict[str, list[Check]] = {}
    for c in previous:
        kept.setdefault(condition_of(c.what), []).append(c)
    checks: list[Check] = []
    for m in measured:
        name = m.condition.name
        if only is not None and name not in only and name in kept:
            checks += kept[name]
            continue
        try:
            found = judge_patched(_under(patched, m.batch), m.batch, m.original, held)
        except Exception as exc:  # noqa: BLE001  (the original ran under it: the patched model raising is a finding)
            text = " ".join(str(exc).split())[:300]
            found = [Check("<model>", type(patched).__name__, "model", "forward", m.original.dtype, float("inf"),
                           float("inf"), False, f"the patched model raised {type(exc).__name__}: {text}")]
        for c in found:
            c.what = f"{c.what} [{name}]"
            c.note = f"{c.note}; under {name}: {m.condition.what}" if c.note else f"under {name}: {m.condition.what}"
        checks += found
    return checks


def condition_of(what: str) -> str:
    """``"logits [left padding]"`` -> ``"left padding"``; the probe's own checks -> ``""``."""
    return what[what.rindex("[") + 1:-1] if what.endswith("]") and "[" in what else ""
