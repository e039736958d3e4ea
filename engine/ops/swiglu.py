"""SwiGLU MLP: ``down(silu(gate(x)) * up(x))``.

The kernel fuses only ``silu(gate) * up``; the projections stay the module's own
submodules and are called as modules, so adapters wrapped around them (PEFT LoRA,
quantized linears) keep working. This is the split Liger-Kernel and ``npu_swiglu`` use.
The gate and up projections are two linears or one fused ``gate_up_proj`` (Phi-3, GLM-4):
see :mod:`engine.ops.gated_mlp`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.ops.base import ModuleOp, register_op
from engine.ops.gated_mlp import bind_gated_mlp, check_gated_mlp, projection_candidates
from engine.schema import GateUpOrder, SwigluPatch

__all__ = ["SwigluOp", "silu_mul_reference"]


def silu_mul_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The ground truth of the ``swiglu`` kernel: ``silu(gate) * up``."""
    return F.silu(gate) * up


@register_op
class SwigluOp(ModuleOp):
    """Replace a gated MLP's forward with ``down(kernel(gate(x), up(x)))``."""

    name = "swiglu"
    patch_type = SwigluPatch

    def reference(self, patch: SwigluPatch) -> Callable[..., Any]:
        return silu_mul_reference

    def check_target(self, module: nn.Module, patch: SwigluPatch) -> None:
        check_gated_mlp(module, patch, self.name, F.silu, "silu")

    def bind(self, module: nn.Module, patch: SwigluPatch, impl: Callable[..., Any]) -> Callable[..., Any]:
        return bind_gated_mlp(patch, impl)

    def alternatives(self, patch: SwigluPatch) -> Iterator[tuple[str, SwigluPatch]]:
        if patch.gate_up_proj is not None:  # the other half as the gate
            other = GateUpOrder.up_gate if patch.chunk_order is GateUpOrder.gate_up else GateUpOrder.gate_up
            yield f"chunk_order: {other.value}", patch.model_copy(update={"chunk_order": other})

    def candidates(self, module: nn.Module) -> Iterator[SwigluPatch]:
        """Every projection assignment that fits by shape (two linears, or one fused gate_up_proj)."""
        target = type(module).__name__
        for settings in projection_candidates(module):
            yield SwigluPatch(op="swiglu", target=target, **settings)
