"""A bf16 model patched with a kernel that rounds once where eager rounds twice.

Such a kernel is not bit-equal to transformers, and after a few layers no fixed tolerance
separates its differences from a bug; verification judges the patched bf16 model's difference
from the original against the original's own rounding error (its distance from the original
evaluated in fp64).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_for

import engine
from engine.kernels import registry


def _fused_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """What a fused kernel does: fp32 inside, one rounding at the end."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def _off_by_three_percent(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up * 1.03


@pytest.fixture
def swiglu_kernels():
    names = []
    for name, fn in (("fused_once", _fused_silu_mul), ("off3pct", _off_by_three_percent)):
        registry.register(registry.KernelProvider(name=name, op="swiglu", devices=registry.ALL_DEVICES,
                                                  build=lambda patch, fn=fn: fn))
        names.append(name)
    yield
    for name in names:
        registry.unregister(name, "swiglu")


def _with_swiglu_kernel(kernel: str) -> dict:
    ps = engine.load_patchset("qwen3").model_dump(mode="json")
    ps["patches"][1]["kernel"] = kernel
    return ps


def test_a_once_rounding_kernel_passes_within_the_original_error(swiglu_kernels) -> None:
    model = tiny_for("qwen3", dtype=torch.bfloat16)
    engine.apply(model, _with_swiglu_kernel("fused_once"), device="cpu")
    report = engine.verify(model)
    rows = {c.what: c for c in report.checks if c.path == "<model>"}
    assert rows["logits"].max_abs > 0  # not bit-equal to the eager bf16 model...
    assert rows["logits"].passed and "the original's own error vs fp64" in rows["logits"].note  # ...but as faithful
    assert rows["grads"].passed
    engine.revert(model)


def test_a_wrong_kernel_still_fails_in_bf16(swiglu_kernels) -> None:
    model = tiny_for("qwen3", dtype=torch.bfloat16)
    engine.apply(model, _with_swiglu_kernel("off3pct"), device="cpu")
    report = engine.verify(model, raise_on_failure=False)
    failed = {(c.path, c.what) for c in report.failures}
    assert ("model.layers.0.mlp", "kernel") in failed
    assert ("<model>", "loss") in failed and ("<model>", "grads") in failed
    loss = next(c for c in report.checks if c.what == "loss")
    times = float(loss.note.split(" = ")[1].split("x ")[0])
    assert times > engine.verification.NOISE_FACTOR  # further from the original than its own rounding error
    engine.revert(model)
