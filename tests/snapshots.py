"""'The model is exactly as it was': a snapshot of everything patching could touch."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn


def snapshot(model: nn.Module) -> dict[str, Any]:
    """Instance forwards, parameters, buffers, and the function namespaces of the model's modules."""
    forwards = {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    namespaces = {}
    for m in model.modules():
        mod = sys.modules.get(type(m).__module__)
        if mod is not None and mod.__name__ not in namespaces:
            namespaces[mod.__name__] = {k: v for k, v in vars(mod).items() if callable(v)}
    return {"forwards": forwards, "params": params, "buffers": buffers, "namespaces": namespaces,
            "attrs": sorted(model.__dict__)}


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before["forwards"] == after["forwards"], "an instance forward changed"
    assert before["attrs"] == after["attrs"], "the model's attributes changed"
    for kind in ("params", "buffers"):
        assert before[kind].keys() == after[kind].keys()
        for k in before[kind]:
            assert torch.equal(before[kind][k], after[kind][k]), f"{kind} {k} changed"
    for ns, fns in before["namespaces"].items():
        for name, fn in fns.items():
            assert after["namespaces"][ns][name] is fn, f"{ns}.{name} was replaced"
