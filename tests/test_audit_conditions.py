"""Conditions of use in the audit's whole-model check (issue 46, item 1, its first conditions; the table is
``engine/_data/conditions.yaml``).

Each condition has a patch written to differ only under it (exact on the 16-token probe: the audit without conditions
passes it) and its exact twin. The patch must differ, naming the condition, with the probe passing; the twin must
pass. One measurement of the original serves every patch (``audit_many``).
"""

from __future__ import annotations

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

#: (the patch that differs only under the condition, its exact twin, the condition)
PAIRS = [
    (wrong_at_one_token, exact_at_one_token, "length 1"),
    (wrong_on_a_partial_tile, exact_in_tiles, "length 17"),
    (wrong_past_64_tokens, exact_in_two_spans, "length 100"),
    (mask_as_if_right_padded, mask_as_given, "left padding"),
    (mask_as_if_left_padded, mask_as_given, "right padding"),
    (loss_scoring_ignored_labels, loss_as_it_was, "ignored labels"),
]


@pytest.fixture(scope="module")
def judged() -> dict[str, Any]:
    model = tiny_for("qwen3").train()
    original = measure_first(model, conditions="all")  # named: the suite's default runs none (conftest.py)
    patches = list(dict.fromkeys(p for pair in PAIRS for p in pair[:2]))
    return {p.__name__: r for p, r in zip(patches, audit_many(model, patches, original=original), strict=True)}


def test_the_declared_conditions_are_data_and_their_batches_are_what_they_say() -> None:
    declared = {c.name: c for c in conditions("all")}
    assert list(declared) == ["length 1", "length 17", "length 100", "left padding", "right padding",
                              "ignored labels"]
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
    report = judged[wrong.__name__]
    failed = [c.what for c in report.model_checks if not c.passed]
    assert report.verdict == "differs" and any(w.endswith(f"[{condition}]") for w in failed), report.summary()
    assert all(w.endswith("]") for w in failed), failed  # the probe's own checks pass: only conditions show it
    named = [part for part in report.summary().split("; ") if " with " in part and condition in part]
    assert named and "the probe (16 tokens" in report.summary(), report.summary()
    twin = judged[exact.__name__]
    assert twin.verdict == "passes", twin.summary()
    assert all(c.passed for c in twin.model_checks) and "cannot see" not in twin.summary()


def test_without_conditions_the_same_patches_pass_as_before(judged) -> None:
    """What the audit said before issue 46: each of these patches passes on the probe alone (``conditions=None``)."""
    model = tiny_for("qwen3").train()
    reports = audit_many(model, [wrong_past_64_tokens, loss_scoring_ignored_labels], conditions=None)
    assert [r.verdict for r in reports] == ["passes", "passes"], [r.summary() for r in reports]
    assert not any(c.what.endswith("]") for r in reports for c in r.model_checks)
