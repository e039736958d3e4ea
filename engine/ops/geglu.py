"""GeGLU MLP: ``down(gelu(gate(x)) * up(x))``, the MLP of Gemma 1/2/3/4.

Gemma's ``hidden_act`` is ``gelu_pytorch_tanh`` (``F.gelu(x, approximate="tanh")``);
``approximate: none`` declares the exact erf GELU. As for SwiGLU, the kernel fuses only
``gelu(gate) * up`` and the projections stay the module's own submodules (see
:mod:`engine.ops.gated_mlp`). The target's activation is compared with the declared GELU
on a probe, bit for bit: ``gelu_new`` / ``gelu_python_tanh`` compute the same function by
another formula and differ in the last bits, so they are refused rather than approximated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.ops.base import ModuleOp, register_op
from engine.ops.gated_mlp import bind_gated_mlp, check_gated_mlp, projection_candidates
from engine.schema import GegluPatch, GeluApproximate, GateUpOrder

__all__ = ["GegluOp", "gelu_mul_reference"]


def gelu_mul_reference(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """The ground truth of the ``geglu`` kernel: ``gelu(gate, approximate) * up`` (as GemmaMLP)."""
    return F.gelu(gate, approximate=approximate) * up


@register_op
class GegluOp(ModuleOp):
    """Replace a GeGLU MLP's forward with ``down(kernel(gate(x), up(x)))``."""

    name = "geglu"
    patch_type = GegluPatch

    def reference(self, patch: GegluPatch) -> Callable[..., Any]:
        if patch.approximate is GeluApproximate.tanh:
            return gelu_mul_reference
        return partial(gelu_mul_reference, approximate=patch.approximate.value)

    def check_target(self, module: nn.Module, patch: GegluPatch) -> None:
        approximate = patch.approximate.value
        check_gated_mlp(
            module, patch, self.name, partial(F.gelu, approximate=approximate), f"gelu(approximate={approximate!r})"
        )

    def bind(self, module: nn.Module, patch: GegluPatch, impl: Callable[..., Any]) -> Callable[..., Any]:
        return bind_gated_mlp(patch, impl)

    def alternatives(self, patch: GegluPatch) -> Iterator[tuple[str, GegluPatch]]:
        for approximate in GeluApproximate:
            if approximate is not patch.approximate:
                yield f"approximate: {approximate.value}", patch.model_copy(update={"approximate": approximate})
        if patch.gate_up_proj is not None:
            other = GateUpOrder.up_gate if patch.chunk_order is GateUpOrder.gate_up else GateUpOrder.gate_up
            yield f"chunk_order: {other.value}", patch.model_copy(update={"chunk_order": other})

    def candidates(self, module: nn.Module) -> Iterator[GegluPatch]:
        """Every projection assignment that fits by shape, with the tanh and the erf GELU."""
        target = type(module).__name__
        for settings in projection_candidates(module):
            for approximate in GeluApproximate:
                yield GegluPatch(op="geglu", target=target, approximate=approximate, **settings)
