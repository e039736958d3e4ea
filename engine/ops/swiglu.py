"""SwiGLU MLP: ``down(silu(gate(x)) * up(x))``.

The kernel fuses only ``silu(gate) * up``; the three projections stay the module's own
submodules and are called as modules, so adapters wrapped around them (PEFT LoRA,
quantized linears) keep working. This is the split Liger-Kernel and ``npu_swiglu`` use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import SignatureMismatch
from engine.ops.base import ModuleOp, register_op, require_single_input
from engine.schema import SwigluPatch

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
        require_single_input(module, self.name)
        cls = type(module).__name__
        for attr in (patch.gate_proj, patch.up_proj, patch.down_proj):
            if not isinstance(getattr(module, attr, None), nn.Module):
                children = ", ".join(name for name, _ in module.named_children()) or "none"
                raise SignatureMismatch(f"{cls} has no submodule {attr!r}; its submodules: {children}")
        act = getattr(module, patch.act_attr, None)
        probe = torch.linspace(-6, 6, 97)
        if not callable(act) or not torch.allclose(act(probe), F.silu(probe), atol=1e-6):
            raise SignatureMismatch(
                f"{cls}.{patch.act_attr} is {type(act).__name__}, which does not compute silu; "
                "swiglu replaces silu-gated MLPs only (check the config's hidden_act)"
            )

    def bind(self, module: nn.Module, patch: SwigluPatch, impl: Callable[..., Any]) -> Callable[..., Any]:
        gate_name, up_name, down_name = patch.gate_proj, patch.up_proj, patch.down_proj

        def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
            modules = self._modules
            return modules[down_name](impl(modules[gate_name](x), modules[up_name](x)))

        return forward
