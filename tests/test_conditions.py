"""Conditions of use in ``verify``, ``apply``'s self-verification and zero configuration (issue 46).

The audit's side (a patch of its own for each condition, and its exact twin) is tests/test_audit_conditions.py.
Here: ``verify`` runs every condition that applies and names the others with a reason; it leaves the model exactly as
it was (parameters, buffers, modes, attention implementation, the caller's gradients); the budget takes conditions in
the table's order by their estimated time; and zero configuration, measuring a user's own norm class that computes
something else only under one condition, no longer patches it (it did with the probe alone).
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from conftest import tiny_for
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

import engine
from engine.verification.conditions import budget_seconds, chosen, declared, not_applicable, table


@pytest.fixture
def conditions_env(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Set ``$PATCH_ENGINE_CONDITIONS`` for one test (the suite's default is none: conftest.py)."""
    return lambda value: monkeypatch.setenv("PATCH_ENGINE_CONDITIONS", value)


def test_the_table_is_data_and_each_condition_says_what_it_catches() -> None:
    rows = table()
    names = [c.name for c in rows]
    assert len(names) == len(set(names)) >= 20
    for expected in ("left padding", "right padding", "ignored labels", "num_items_in_batch", "router logits",
                     "packed sequences", "eval mode", "no_grad", "inference_mode", "bf16", "fp16", "autocast",
                     "repeated calls", "optimizer step", "generation", "gradient checkpointing", "eager attention",
                     "sdpa attention", "length 1", "length 17", "length 100", "length 129", "batch 1"):
        assert expected in names
    assert all(c.what and c.catches and c.cost > 0 for c in rows)
    assert budget_seconds() == 2.0
    with pytest.raises(ValueError, match="no condition 'nope'"):
        declared(["nope"])


def test_verify_runs_every_condition_that_applies_and_names_the_others(conditions_env: Any) -> None:
    conditions_env("all")
    model = tiny_for("qwen3").train()
    report = engine.verify(model, "qwen3", device="cpu")
    assert report.passed
    assert {"right padding", "optimizer step", "generation", "bf16", "repeated calls", "gradient checkpointing",
            "sdpa attention", "length 129"} <= set(report.conditions)
    assert "does not route" in report.conditions_not_run["router logits"]
    assert "eager attention by default" in report.conditions_not_run["eager attention"]
    assert "train mode" in report.conditions_not_run["train mode"]
    assert set(report.conditions) | set(report.conditions_not_run) == {c.name for c in table()}
    labelled = {c.what for c in report.checks if c.what.endswith("[optimizer step]")}
    assert labelled == {"logits [optimizer step]", "loss [optimizer step]", "grads [optimizer step]"}
    assert "state [repeated calls]" in {c.what for c in report.checks}
    assert not any(c.what.endswith("[no_grad]") and c.what.startswith("grads") for c in report.checks)
    assert "conditions of use" in report.headline()
    assert report.to_dict()["conditions"]["ran"] == report.conditions


def test_verify_under_every_condition_leaves_the_model_exactly_as_it_was(conditions_env: Any) -> None:
    conditions_env("all")
    model = tiny_for("qwen3").eval()
    engine.apply(model, "qwen3", device="cpu")
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    storage = {n: p.data_ptr() for n, p in model.named_parameters()}
    model.lm_head.weight.grad = torch.full_like(model.lm_head.weight, 3.0)  # the caller's, kept
    attention = model.config._attn_implementation
    report = engine.verify(model)
    assert {"train mode", "bf16", "optimizer step", "gradient checkpointing", "sdpa attention"} <= set(
        report.conditions)
    for n, p in model.named_parameters():
        assert p.data_ptr() == storage[n] and p.dtype == torch.float32 and torch.equal(p, params[n]), n
        assert (p.grad is None) == (n != "lm_head.weight"), n
    assert torch.equal(model.lm_head.weight.grad, torch.full_like(model.lm_head.weight, 3.0))
    assert all(torch.equal(b, buffers[n]) for n, b in model.named_buffers())
    assert not any(m.training for m in model.modules())
    assert model.config._attn_implementation == attention and not model.is_activation_checkpointing


def test_apply_and_zero_configuration_take_the_conditions_in_order_within_the_budget(conditions_env: Any) -> None:
    conditions_env("budget")  # what a user's apply runs (the suite's default is none)
    model = tiny_for("qwen3").train()
    applying = [c for c in table() if not not_applicable(model, c)]
    fast, _ = chosen(model, "budget", probe_seconds=0.001)
    assert fast == applying  # a tiny model's probe is milliseconds: every condition fits
    slow, skipped = chosen(model, "budget", probe_seconds=2.0)  # a probe of 2 s: a few cheap ones fit
    assert slow and slow == [c for c in applying if c in slow]  # in the table's order
    assert sum(c.cost * 2.0 for c in slow) <= budget_seconds() < sum(c.cost * 2.0 for c in applying)
    over = [c.name for c in applying if c not in slow]
    assert over and all("over the 2 s budget" in skipped[n] and "engine.verify(model) runs it" in skipped[n]
                        for n in over)
    assert "does not route" in skipped["router logits"]  # what does not apply says so, not the budget


# zero configuration: a user's own norm class, measured on a tiny copy, that differs only under one condition


def _recomputing() -> bool:
    return any(f.function == "recompute_fn" for f in inspect.stack(0)[:40])


#: condition -> when the user's norm computes something else (x 1.1) than RMSNorm (what the kernel computes)
SWITCHES = {
    "length 17": lambda self, x: x.dim() == 3 and x.shape[1] > 16,
    "eval mode": lambda self, x: not self.training,
    "no_grad": lambda self, x: not torch.is_grad_enabled() and x.dim() == 3 and x.shape[1] > 1,
    "inference_mode": lambda self, x: torch.is_inference_mode_enabled(),
    "batch 1": lambda self, x: x.dim() == 3 and x.shape[0] == 1,
    "generation": lambda self, x: x.dim() == 3 and x.shape[1] == 1 and not torch.is_grad_enabled(),
    "autocast": lambda self, x: torch.is_autocast_enabled(x.device.type),
    "fp16": lambda self, x: x.dtype == torch.float16,
    "gradient checkpointing": lambda self, x: _recomputing(),
}


class _Switching(Qwen3RMSNorm):
    """A user's RMSNorm that computes something else (x 1.1) where its ``switch`` says so."""

    switch: Any = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = super().forward(hidden_states)
        return out * 1.1 if type(self).switch(self, hidden_states) else out


class _CachingNorm(Qwen3RMSNorm):
    """A user's RMSNorm that reads its weight as it was at its first call (stale after an optimizer step)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if "_first" not in self.__dict__:
            self.__dict__["_first"] = self.weight.detach().clone()
        return super().forward(hidden_states) * (self.__dict__["_first"] / self.weight.detach())


class _CountingNorm(Qwen3RMSNorm):
    """A user's RMSNorm that counts its calls in a buffer (module state a kernel would not update)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.calls += 1
        return super().forward(hidden_states)


def _user_model(condition: str) -> nn.Module:
    model = tiny_for("qwen3").train()
    cls = type(f"Norm_{condition.replace(' ', '_')}", (_Switching,), {"switch": staticmethod(SWITCHES[condition])})
    for m in model.modules():
        if type(m) is Qwen3RMSNorm:
            m.__class__ = cls
    return model


def _norm_patched(report: Any) -> bool:
    return any(d.action == "patch" and d.op == "rms_norm" for d in report.decisions)


#: Conditions under which zero configuration patched such a norm with the probe alone, and no longer does.
CAUGHT_NOW = ["eval mode", "inference_mode", "autocast"]
#: Conditions whose norm the module checks (run under no_grad, at one row and at the user's own size: 129 rows,
#: batch 1) already left unpatched before the conditions existed: they stay unpatched.
CAUGHT_BEFORE = ["length 17", "batch 1", "generation", "no_grad"]


@pytest.mark.parametrize("condition", CAUGHT_NOW)
def test_zero_configuration_no_longer_patches_a_norm_that_differs_under_a_condition(
        condition: str, conditions_env: Any) -> None:
    conditions_env("none")  # the probe alone, as zero configuration measured before: the norm is patched, wrongly
    before = engine.apply(_user_model(condition), device="cpu")
    assert _norm_patched(before), before
    conditions_env(condition)  # a verdict's key holds the conditions: the one above is not reused
    model = _user_model(condition)
    with pytest.warns(engine.errors.ZeroConfigWarning, match="failed verification"):
        report = engine.apply(model, device="cpu")
    assert not _norm_patched(report), report
    assert any(d.op != "rms_norm" and d.action == "patch" for d in report.decisions)  # the rest still patched
    assert f"[{condition}]" in str(report)


@pytest.mark.parametrize("condition", CAUGHT_BEFORE)
def test_a_norm_the_module_checks_already_catch_stays_unpatched(condition: str, conditions_env: Any) -> None:
    conditions_env("none")
    report = engine.apply(_user_model(condition), device="cpu")
    assert not _norm_patched(report), report


@pytest.mark.parametrize("cls", [_CachingNorm, _CountingNorm])
def test_a_norm_with_state_or_a_cached_weight_is_not_declared_as_rms_norm(cls: type, conditions_env: Any) -> None:
    """The stale weight (optimizer step) and the call-counting buffer (repeated calls) are not what the rms_norm op
    declares: zero configuration's scaffold leaves them undeclared with the probe alone, and the conditions keep it."""
    for env in ("none", "optimizer step,repeated calls"):
        conditions_env(env)
        model = tiny_for("qwen3").train()
        for m in model.modules():
            if type(m) is Qwen3RMSNorm:
                m.__class__ = cls
                if cls is _CountingNorm:
                    m.register_buffer("calls", torch.zeros(()))
        report = engine.apply(model, device="cpu")
        assert not _norm_patched(report), (env, report)
        x = torch.randint(0, 100, (1, 8))
        model(input_ids=x)  # the model still runs its own norms


def test_the_documented_table_is_the_declared_one() -> None:
    """docs/verification.md's table of conditions: a row for each declared condition, its words and cost as declared."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "verification.md").read_text(encoding="utf-8")
    section = text[text.index("### Conditions of use"):text.index("### The judge")]
    rows = {line.split(" | ")[0].strip("| "): line for line in section.splitlines() if line.startswith("| ")}
    for c in table():
        assert c.name in rows, f"docs/verification.md has no row for condition {c.name!r}"
        assert rows[c.name] == f"| {c.name} | {c.what} | {c.catches} | {c.cost:g} |", rows[c.name]


def test_a_label_less_low_precision_loss_is_judged_by_its_logits_noise() -> None:
    """One token or decoding scores no token: the loss is the logits' mean square. In bf16 its noise comes from the
    logits' own errors (not from how close one number landed to its truth by luck): a patched loss off by that much
    passes, one off by far more fails."""
    from engine.verification.low_precision import judge_loss
    from engine.verification.verdicts import loss_noise

    gen = torch.Generator().manual_seed(0)
    exact = torch.randn(2, 5, 64, generator=gen, dtype=torch.float64)
    original = exact.to(torch.bfloat16)
    typical = loss_noise({"logits": ("logits", None, original)}, "logits", {"logits": exact, "loss": exact.square()
                                                                               .mean()}, {"input_ids": None})
    assert typical is not None and typical > 0
    want = original.float().square().mean()
    truth = exact.square().mean().float()
    assert judge_loss(want + typical, want, truth, typical)[0]
    assert not judge_loss(want + 100 * typical, want, truth, typical)[0]
