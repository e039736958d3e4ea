"""Conditions of use in the audit's whole-model check (issue 46, item 1, its first conditions; the table is
``engine/_data/conditions.yaml``).

Each condition has a patch written to differ only under it (exact on the 16-token probe: the audit without conditions
passes it) and its exact twin. The patch must differ, naming the condition, with the probe passing; the twin must
pass. One measurement of the original serves every patch (``audit_many``).
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import pytest
import torch
from conftest import tiny_for
from torch import nn

from engine.auditing import audit_many, measure_first
from engine.auditing.conditions import condition_batch, conditions


def _each(model: nn.Module, cls: str, wrap: Any) -> None:
    for m in model.modules():
        if type(m).__name__ == cls:
            own = type(m).forward
            m.forward = types.MethodType(lambda self, *a, _own=own, **k: wrap(self, _own, *a, **k), m)


def _norms(model: nn.Module, wrap: Any) -> None:
    """Qwen3's norms on (batch, length, hidden) inputs (the q/k norms' per-head inputs left as they are)."""
    _each(model, "Qwen3RMSNorm", lambda self, own, x: wrap(self, own, x) if x.dim() == 3 else own(self, x))


# length 1: a special case for one token
def wrong_at_one_token(model: nn.Module) -> None:
    _norms(model, lambda self, own, x: own(self, x) * 1.01 if x.shape[1] == 1 else own(self, x))


def exact_at_one_token(model: nn.Module) -> None:
    _norms(model, lambda self, own, x: own(self, x[:, 0])[:, None] if x.shape[1] == 1 else own(self, x))


# length 17: the last, partial 16-row tile
def _tiles(self: nn.Module, own: Any, x: torch.Tensor, wrong: bool) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    parts = [own(self, rows[i:i + 16]) for i in range(0, rows.shape[0], 16)]
    if wrong and rows.shape[0] % 16:
        parts[-1] = parts[-1] * 1.01
    return torch.cat(parts).reshape(x.shape)


def wrong_on_a_partial_tile(model: nn.Module) -> None:
    _norms(model, lambda self, own, x: _tiles(self, own, x, wrong=True))


def exact_in_tiles(model: nn.Module) -> None:
    _norms(model, lambda self, own, x: _tiles(self, own, x, wrong=False))


# length 100: past 64 tokens
def wrong_past_64_tokens(model: nn.Module) -> None:
    def wrap(self: nn.Module, own: Any, x: torch.Tensor) -> torch.Tensor:
        out = own(self, x)
        return torch.cat([out[:, :64], out[:, 64:] * 1.01], 1) if x.shape[1] > 64 else out
    _norms(model, wrap)


def exact_in_two_spans(model: nn.Module) -> None:
    def wrap(self: nn.Module, own: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([own(self, x[:, :64]), own(self, x[:, 64:])], 1) if x.shape[1] > 64 else own(self, x)
    _norms(model, wrap)


# left and right padding: the attention's mask rebuilt from each row's count of real tokens
def _rebuilt(mask: torch.Tensor | None, side: str) -> torch.Tensor | None:
    """An eager 4-D additive mask rebuilt: causal, and the keys real as if padding were on ``side`` (``as given``:
    the same keys as the mask's own)."""
    if mask is None or mask.dim() != 4:
        return mask
    if side == "as given":  # the same keys for every query as the mask's own (a packed batch's blocks included)
        allowed = mask == 0
        rebuilt = torch.zeros_like(mask).masked_fill(~allowed, torch.finfo(mask.dtype).min)
        return mask + (rebuilt - mask).detach()
    keys = mask[:, 0, -1, :] == 0  # the last query sees every real key, whichever side the padding is on
    length, count = keys.shape[-1], keys.sum(-1, keepdim=True)
    where = torch.arange(length, device=mask.device)[None]
    real = {"right": where < count, "left": where >= length - count, "as given": keys}[side]
    causal = torch.ones(mask.shape[-2], length, dtype=torch.bool, device=mask.device).tril(length - mask.shape[-2])
    allowed = causal[None, None] & real[:, None, None, :]
    rebuilt = torch.zeros_like(mask).masked_fill(~allowed, torch.finfo(mask.dtype).min)
    return mask + (rebuilt - mask).detach()  # the rebuilt values, bit for bit; the mask's gradient flows as before


def _attention(side: str) -> Any:
    def patch(model: nn.Module) -> None:
        def wrap(self: nn.Module, own: Any, *a: Any, attention_mask: Any = None, **k: Any) -> Any:
            return own(self, *a, attention_mask=_rebuilt(attention_mask, side), **k)
        _each(model, "Qwen3Attention", wrap)
    patch.__name__ = patch.__qualname__ = f"mask_rebuilt_{side.replace(' ', '_')}"
    return patch


mask_as_if_right_padded, mask_as_if_left_padded, mask_as_given = (_attention(s) for s in ("right", "left", "as given"))


# labels with -100: a loss (transformers' LOSS_MAPPING entry) that scores -100 as token 0
def _loss(wrong: bool) -> Any:
    def patch(model: nn.Module) -> None:
        from transformers.loss.loss_utils import LOSS_MAPPING

        real = LOSS_MAPPING["ForCausalLM"]

        def loss(logits: torch.Tensor, labels: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            return real(logits, labels.masked_fill(labels == -100, 0) if wrong else labels, *args, **kwargs)

        LOSS_MAPPING["ForCausalLM"] = loss
    patch.__name__ = patch.__qualname__ = "loss_scoring_ignored_labels" if wrong else "loss_as_it_was"
    return patch


loss_scoring_ignored_labels, loss_as_it_was = _loss(True), _loss(False)

def _named(name: str, patch: Any) -> Any:
    patch.__name__ = patch.__qualname__ = name
    return patch


def _norm_pair(condition: str, when: Any, by: float = 1.01) -> tuple[Any, Any]:
    """A norm wrong (x ``by``) where ``when(self, x)`` holds, and its twin: an exact other path there (a copy of the
    input: what a kernel's layout change does). In bf16 and fp16 1% is a rounding step: ``by`` is 10% there."""
    slug = condition.replace(" ", "_")
    wrong = _named(f"norm_wrong_{slug}", lambda model: _norms(
        model, lambda self, own, x: own(self, x) * by if when(self, x) else own(self, x)))
    exact = _named(f"norm_exact_{slug}", lambda model: _norms(
        model, lambda self, own, x: own(self, x.clone()) if when(self, x) else own(self, x)))
    return wrong, exact


def _recomputing() -> bool:
    """Inside torch.utils.checkpoint's recomputation of a checkpointed forward (during the backward)."""
    return any(f.function == "recompute_fn" for f in inspect.stack(0)[:40])


# optimizer step: the weight cached at the first call (its gradient still flows), stale after a step
def _cached_weight(fresh: bool) -> Any:
    def patch(model: nn.Module) -> None:
        def wrap(self: nn.Module, own: Any, x: torch.Tensor) -> torch.Tensor:
            if fresh or "_cached" not in self.__dict__:
                self.__dict__["_cached"] = self.weight.detach().clone()
            return own(self, x) * (self.__dict__["_cached"] / self.weight.detach())
        _norms(model, wrap)
    return _named("weight_cached_at_first_call" if not fresh else "weight_read_at_each_call", patch)


# repeated calls: a norm that keeps a running statistic in a buffer each call (module state the original does not
# have: what a kernel's leftover workspace or a stats hook leaves); its twin counts its calls in a plain attribute
def _counting(wrong: bool) -> Any:
    def patch(model: nn.Module) -> None:
        for m in model.modules():
            if type(m).__name__ == "Qwen3RMSNorm" and wrong:
                m.register_buffer("running_square", torch.zeros(()))

        def wrap(self: nn.Module, own: Any, x: torch.Tensor) -> torch.Tensor:
            if wrong:
                with torch.no_grad():
                    self.running_square.mul_(0.9).add_(0.1 * x.float().square().mean())
            else:
                self.__dict__["calls"] = self.__dict__.get("calls", 0) + 1
            return own(self, x)
        _norms(model, wrap)
    return _named("keeps_a_running_statistic" if wrong else "counts_its_calls_harmlessly", patch)


# num_items_in_batch: a loss that drops it (wrong on every accumulated batch)
def _items(wrong: bool) -> Any:
    def patch(model: nn.Module) -> None:
        from transformers.loss.loss_utils import LOSS_MAPPING

        real = LOSS_MAPPING["ForCausalLM"]

        def loss(logits: torch.Tensor, labels: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if wrong:
                kwargs.pop("num_items_in_batch", None)
            return real(logits, labels, *args, **kwargs)

        LOSS_MAPPING["ForCausalLM"] = loss
    return _named("loss_ignoring_num_items_in_batch" if wrong else "loss_passing_num_items_in_batch", patch)


# packed sequences: the attention's mask rebuilt as plain causal, so a packed row's second document sees its first
# (rotary positions restarting change nothing: a rotary product depends on the distance of two positions only)
def _causal(mask: torch.Tensor | None) -> torch.Tensor | None:
    if mask is None or mask.dim() != 4:
        return mask
    queries, keys = mask.shape[-2:]
    allowed = torch.ones(queries, keys, dtype=torch.bool, device=mask.device).tril(keys - queries)
    rebuilt = torch.zeros_like(mask).masked_fill(~allowed, torch.finfo(mask.dtype).min)
    return mask + (rebuilt - mask).detach()


def mask_rebuilt_causal(model: nn.Module) -> None:
    def wrap(self: nn.Module, own: Any, *a: Any, attention_mask: Any = None, **k: Any) -> Any:
        return own(self, *a, attention_mask=_causal(attention_mask), **k)
    _each(model, "Qwen3Attention", wrap)


# sdpa attention: an attention wrong only under the sdpa implementation
def _sdpa(wrong: bool) -> Any:
    def patch(model: nn.Module) -> None:
        def wrap(self: nn.Module, own: Any, *a: Any, **k: Any) -> Any:
            out, weights = own(self, *a, **k)
            return (out * 1.01 if wrong and self.config._attn_implementation == "sdpa" else out), weights
        _each(model, "Qwen3Attention", wrap)
    return _named("attention_wrong_under_sdpa" if wrong else "attention_as_it_was", patch)


def _dtype_is(dtype: torch.dtype) -> Any:
    return lambda self, x: x.dtype == dtype


#: (the patch that differs only under the condition, its exact twin, the condition)
PAIRS = [
    (wrong_at_one_token, exact_at_one_token, "length 1"),
    (wrong_on_a_partial_tile, exact_in_tiles, "length 17"),
    (wrong_past_64_tokens, exact_in_two_spans, "length 100"),
    (mask_as_if_right_padded, mask_as_given, "left padding"),
    (mask_as_if_left_padded, mask_as_given, "right padding"),
    (loss_scoring_ignored_labels, loss_as_it_was, "ignored labels"),
    (*_norm_pair("eval mode", lambda self, x: not self.training), "eval mode"),
    (_cached_weight(False), _cached_weight(True), "optimizer step"),
    (_counting(True), _counting(False), "repeated calls"),
    (*_norm_pair("generation", lambda self, x: x.shape[1] == 1 and not torch.is_grad_enabled()), "generation"),
    (_items(True), _items(False), "num_items_in_batch"),
    (*_norm_pair("no_grad", lambda self, x: not torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
                 and x.shape[1] > 1), "no_grad"),
    (*_norm_pair("batch 1", lambda self, x: x.shape[0] == 1), "batch 1"),
    (mask_rebuilt_causal, mask_as_given, "packed sequences"),
    (*_norm_pair("gradient checkpointing", lambda self, x: _recomputing()), "gradient checkpointing"),
    (_sdpa(True), _sdpa(False), "sdpa attention"),
    (*_norm_pair("autocast", lambda self, x: torch.is_autocast_enabled(x.device.type), 1.1), "autocast"),
    (*_norm_pair("bf16", _dtype_is(torch.bfloat16), 1.1), "bf16"),
    (*_norm_pair("fp16", _dtype_is(torch.float16), 1.1), "fp16"),
    (*_norm_pair("inference_mode", lambda self, x: torch.is_inference_mode_enabled()), "inference_mode"),
    (*_norm_pair("length 129", lambda self, x: x.shape[1] > 128), "length 129"),
]


@pytest.fixture(scope="module")
def judged() -> dict[tuple[str, str], Any]:
    """Each pair judged on the probe and under its own condition (the original measured once under all of them:
    every condition, on every patch, is the CLI's default and minutes here)."""
    model = tiny_for("qwen3").train()
    original = measure_first(model, conditions="all")  # named: the suite's default runs none (conftest.py)
    every, out = original.conditions, {}
    for wrong, exact, condition in PAIRS:
        original.conditions = [m for m in every if m.condition.name == condition]
        assert original.conditions, f"{condition} does not apply to the tiny qwen3"
        for patch, report in zip((wrong, exact), audit_many(model, [wrong, exact], original=original), strict=True):
            out[patch.__name__, condition] = report
    original.conditions = every
    return out


def test_the_declared_conditions_are_data_and_their_batches_are_what_they_say() -> None:
    declared = {c.name: c for c in conditions("all")}
    assert {"length 1", "length 17", "length 100", "left padding", "right padding", "ignored labels"} <= set(declared)
    model = tiny_for("qwen3")
    left, right = condition_batch(model, declared["left padding"]), condition_batch(model, declared["right padding"])
    assert left["attention_mask"][0, :7].eq(0).all() and left["attention_mask"][0, 7:].eq(1).all()
    assert right["attention_mask"][0, -7:].eq(0).all() and left["attention_mask"][1].eq(1).all()
    assert (left["labels"][0, :7] == -100).all() and (left["labels"][0, 7:] != -100).all()
    ignored = condition_batch(model, declared["ignored labels"])
    assert (ignored["labels"][1, :5] == -100).all() and "attention_mask" not in ignored
    assert "labels" not in condition_batch(model, declared["length 1"])  # one token: nothing to score
    with pytest.raises(ValueError, match="no condition 'nope'"):
        conditions(["nope"])


@pytest.mark.parametrize(("wrong", "exact", "condition"), PAIRS, ids=[p[2] for p in PAIRS])
def test_a_patch_wrong_only_under_a_condition_differs_naming_it_and_its_exact_twin_passes(
        judged, wrong, exact, condition) -> None:
    report = judged[wrong.__name__, condition]
    failed = [c.what for c in report.model_checks if not c.passed]
    assert report.verdict == "differs" and any(w.endswith(f"[{condition}]") for w in failed), report.summary()
    assert all(w.endswith("]") for w in failed), failed  # the probe's own checks pass: only conditions show it
    named = [part for part in report.summary().split("; ") if " with " in part and condition in part]
    assert named and "(16 tokens, no padding, no -100 label) pass" in report.summary(), report.summary()
    twin = judged[exact.__name__, condition]
    assert twin.verdict == "passes", twin.summary()
    assert all(c.passed for c in twin.model_checks) and "cannot see" not in twin.summary()


def test_without_conditions_the_same_patches_pass_as_before(judged) -> None:
    """What the audit said before issue 46: each of these patches passes on the probe alone (``conditions=None``)."""
    model = tiny_for("qwen3").train()
    reports = audit_many(model, [wrong_past_64_tokens, loss_scoring_ignored_labels], conditions=None)
    assert [r.verdict for r in reports] == ["passes", "passes"], [r.summary() for r in reports]
    assert not any(c.what.endswith("]") for r in reports for c in r.model_checks)


# conditions that need another model or mode than the tiny qwen3 in train mode with eager attention


def _eval_qwen3() -> nn.Module:
    return tiny_for("qwen3").eval()


def _sdpa_qwen3() -> nn.Module:
    model = tiny_for("qwen3").train()
    model.set_attn_implementation("sdpa")  # as from_pretrained loads it: eager is then the other implementation
    return model


def _gemma3() -> nn.Module:
    return tiny_for("gemma3_text", sliding_window=24).train()  # past the probe's 16 tokens: the condition runs 33


def _moe() -> nn.Module:
    return tiny_for("qwen3_moe").train()


def _attention_under(implementation: str, wrong: bool) -> Any:
    def patch(model: nn.Module) -> None:
        def wrap(self: nn.Module, own: Any, *a: Any, **k: Any) -> Any:
            out, weights = own(self, *a, **k)
            changed = wrong and self.config._attn_implementation == implementation
            return (out * 1.01 if changed else out), weights
        _each(model, "Qwen3Attention", wrap)
    return _named(f"attention_wrong_under_{implementation}" if wrong else "attention_unchanged", patch)


def _gemma_norms(model: nn.Module, wrap: Any) -> None:
    _each(model, "Gemma3RMSNorm", lambda self, own, x: wrap(self, own, x) if x.dim() == 3 else own(self, x))


def _past_window(wrong: bool) -> Any:
    def patch(model: nn.Module) -> None:
        window = model.config.sliding_window
        _gemma_norms(model, lambda self, own, x: (own(self, x) * 1.01 if wrong else own(self, x.clone()))
                     if x.shape[1] > window else own(self, x))
    return _named("norm_wrong_past_the_window" if wrong else "norm_exact_past_the_window", patch)


def _aux_loss(scale: float) -> Any:
    def patch(model: nn.Module) -> None:
        model.router_aux_loss_coef = model.router_aux_loss_coef * scale  # what the loss adds of the router's balance
    return _named("router_aux_loss_x500" if scale != 1 else "router_aux_loss_as_it_was", patch)


#: (the model, the patch that differs only under the condition, its exact twin, the condition)
OTHER_PAIRS = [
    (_eval_qwen3, *_norm_pair("train mode", lambda self, x: self.training), "train mode"),
    (_sdpa_qwen3, _attention_under("eager", True), _attention_under("eager", False), "eager attention"),
    (_gemma3, _past_window(True), _past_window(False), "past the sliding window"),
    (_moe, _aux_loss(500.0), _aux_loss(1.0), "router logits"),
]


@pytest.mark.parametrize(("build", "wrong", "exact", "condition"), OTHER_PAIRS, ids=[p[3] for p in OTHER_PAIRS])
def test_a_patch_wrong_only_under_a_condition_of_another_model_differs_and_its_twin_passes(
        build, wrong, exact, condition) -> None:
    model = build()
    original = measure_first(model, conditions=[condition])
    assert original.conditions, f"{condition} does not apply to {type(model).__name__}"
    report, twin = audit_many(model, [wrong, exact], original=original)
    failed = [c.what for c in report.model_checks if not c.passed]
    assert report.verdict == "differs" and any(w.endswith(f"[{condition}]") for w in failed), report.summary()
    assert all(w.endswith("]") for w in failed), failed
    assert twin.verdict in ("passes", "unchanged"), twin.summary()  # x 1.0: the same numbers, "changed nothing"


def test_the_summary_says_the_probe_passes_only_where_nothing_found_on_it_differs() -> None:
    """A condition's finding beside a change that differs on the probe's own recorded inputs (Liger's OLMo 2 in bf16:
    its norms' cast order, and its loss under length 1): only the probe's whole-model checks pass, and the summary
    says that, not that the probe passes."""
    from engine.auditing.report import AuditReport, Row
    from engine.verification.results import Check

    def check(what: str, passed: bool) -> Check:
        return Check("<model>", "Olmo2ForCausalLM", "-", what, "bf16", 0.001, 0.0, passed, "")
    checks = [check("logits (no labels)", True), check("loss", True), check("grads", True),
              check("logits [length 1]", True), check("loss [length 1]", False)]
    norm = Row("model.norm", "Olmo2RMSNorm", "forward replaced", "LigerRMSNorm.forward", "differs", 0.03, 2.4,
               explanation="computes cast: llama where Olmo2RMSNorm.forward computes cast: fp32 (exactly)")
    report = AuditReport("liger", "Olmo2ForCausalLM", "olmo2", "bf16", rows=[norm], model_checks=checks)
    said = report.summary()
    assert "loss differs with length 1" in said and "Olmo2RMSNorm differs" in said, said
    assert "the probe's logits, loss and grads (16 tokens, no padding, no -100 label) pass" in said, said
    assert "the probe (16 tokens" not in said, said
    report.rows = []
    assert "the probe (16 tokens, no padding, no -100 label) passes" in report.summary()
