"""Conditions of use (``engine/_data/conditions.yaml``, :mod:`engine.verification.conditions`) in the audit.

Why: every check an audit ran was one scenario, 2 sequences of 16 random tokens with no attention mask and no
``-100`` label, one call, no step, no cache. A norm wrong on its last partial 16-row tile, a mask rebuilt as if padding
were on the right, a loss that scores ``-100`` as token 0, a weight cached at the first call: each is exact there and
wrong where every user runs it (issue 46). Each condition's original is measured with the rest of the original
(logits, loss, every gradient, the fp64 truth), before any patch exists, and the patched copy is judged under it by
the same rule (:mod:`engine.auditing.whole_model`); its checks are the probe's, labelled with the condition
(``logits [left padding]``), so every locator and the verdict treat them alike. The table is the one ``verify`` and
zero configuration read; ``"default"`` here is the conditions marked ``audit``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.auditing.whole_model import OriginalRun, judge_patched, measure_original
from engine.verification.conditions import Condition, condition_of, declared, label_checks, not_applicable
from engine.verification.results import Check
from engine.verification.scenario import Scenario

__all__ = ["Condition", "Measured", "condition_batch", "condition_of", "conditions", "judge_conditions",
           "measure_conditions"]

#: What ``"default"`` means where set: ``none``, ``all``, or comma-separated names. The suite sets ``none`` (its
#: audit tests judge other things, and each condition costs a run of the model per patch); the conditions' own
#: tests name theirs. Unset: the conditions marked ``audit`` in conditions.yaml.
DEFAULT_ENV_VAR = "PATCH_ENGINE_AUDIT_CONDITIONS"


def conditions(names: Iterable[str] | str | None = "default") -> list[Condition]:
    """The declared conditions: ``"default"`` (those marked ``audit``, or ``$PATCH_ENGINE_AUDIT_CONDITIONS``),
    ``"all"``, None or ``()`` (none), or names."""
    found = declared("audit", env=DEFAULT_ENV_VAR) if names == "default" else declared(names, env="")
    return found if isinstance(found, list) else []


def condition_batch(model: nn.Module, condition: Condition, given: dict[str, Any] | None = None) -> dict[str, Any]:
    """The condition's batch: its own (token ids of its length, its mask and labels), else ``given``."""
    from engine.verification.probes import probe_batch

    return Scenario(condition).batch(model, given if given is not None else probe_batch(model))


@dataclass
class Measured:
    """A condition, its scenario (which keeps what later runs need: the original's tokens, its module state), its
    batch and the original's numbers under it."""

    condition: Condition
    batch: dict[str, Any]
    original: OriginalRun
    scenario: Scenario | None = None


def measure_conditions(model: nn.Module, held: torch.device, wanted: Sequence[Condition],
                       batch: dict[str, Any] | None = None) -> list[Measured]:
    """The original under each condition that applies to it (before any patch exists), as the probe's is measured."""
    from engine.verification.probes import probe_batch

    given = batch if batch is not None else probe_batch(model)
    out = []
    for condition in wanted:
        if not_applicable(model, condition):
            continue
        scenario = Scenario(condition)
        run_batch = scenario.batch(model, given)
        out.append(Measured(condition, run_batch, measure_original(model, run_batch, held, scenario=scenario),
                            scenario))
    return out


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
        scenario = m.scenario or Scenario(m.condition)
        try:
            found = judge_patched(patched, m.batch, m.original, held, scenario=scenario)
            state = scenario.state_check(type(patched).__name__)
            found += [state] if state is not None else []
        except Exception as exc:  # noqa: BLE001  (the original ran under it: the patched model raising is a finding)
            text = " ".join(str(exc).split())[:300]
            found = [Check("<model>", type(patched).__name__, "model", "forward", m.original.dtype, float("inf"),
                           float("inf"), False, f"the patched model raised {type(exc).__name__}: {text}")]
        checks += label_checks(found, m.condition)
    return checks
