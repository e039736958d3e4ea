"""One rule for where a kernel rounds, whatever the op (issue 46, item 3).

A norm that computes another cast order and an MLP that rounds once less are the same kind of change: a fused kernel
that keeps fp32 one step longer. They get the same verdict: judged by their accuracy against fp64 (within the
original's rounding error and not coarser: passes, the cast order named), while a kernel that rounds *more* (a step
in a lower precision) differs, whichever op it is. Tiny qwen3 in bf16, where cast orders differ.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from conftest import tiny_for
from torch import nn

from engine.auditing import audit_many


def _each(model: nn.Module, cls: str, forward: Any) -> None:
    for m in model.modules():
        if type(m).__name__ == cls:
            m.forward = types.MethodType(forward, m)


def norm_rounds_once_less(model: nn.Module) -> None:
    """The weight multiplied in fp32, one rounding at the end (transformers' Qwen3 rounds, then multiplies in bf16)."""
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (self.weight.float() * h).to(x.dtype)
    _each(model, "Qwen3RMSNorm", forward)


def mlp_rounds_once_less(model: nn.Module) -> None:
    """act(gate) * up in fp32, one rounding before down (transformers rounds act(gate), then the product)."""
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj((self.act_fn(gate.float()) * up.float()).to(x.dtype))
    _each(model, "Qwen3MLP", forward)


def norm_rounds_more(model: nn.Module) -> None:
    """The variance in bf16: a step in a lower precision than the original's fp32."""
    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)  # bf16
        h = x.float() * torch.rsqrt(variance.float() + self.variance_epsilon)
        return self.weight * h.to(x.dtype)
    _each(model, "Qwen3RMSNorm", forward)


@pytest.fixture(scope="module")
def judged() -> dict[str, Any]:
    model = tiny_for("qwen3", dtype=torch.bfloat16).train()
    patches = [norm_rounds_once_less, mlp_rounds_once_less, norm_rounds_more]
    return {p.__name__: r for p, r in zip(patches, audit_many(model, patches, conditions=None), strict=True)}


def test_a_norm_and_an_mlp_that_round_once_less_get_the_same_verdict(judged: dict[str, Any]) -> None:
    norm, mlp = judged["norm_rounds_once_less"], judged["mlp_rounds_once_less"]
    assert norm.verdict == mlp.verdict == "passes", (norm.summary(), mlp.summary())
    rows = [r for r in norm.rows if r.cls == "Qwen3RMSNorm"]
    assert rows and all(r.result in ("passes", "same") for r in rows)
    named = [r for r in rows if r.explanation]
    assert named and all("cast" in r.explanation for r in named), [r.explanation for r in rows]  # the order, named
    assert any("rounds otherwise" in r.note for r in rows), [r.note for r in rows]


def test_a_kernel_that_rounds_more_differs(judged: dict[str, Any]) -> None:
    report = judged["norm_rounds_more"]
    assert report.verdict == "differs", report.summary()
    assert any(r.result == "differs" and "rounds more" in (r.note + r.explanation) for r in report.rows)
