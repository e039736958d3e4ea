"""SwiGLU MLP: ``down(silu(gate(x)) * up(x))``.

The kernel fuses only ``silu(gate) * up``; the three projections stay the module's own
submodules and are called as modules, so adapters wrapped around them (PEFT LoRA,
quantized linears) keep working. This is the split Liger-Kernel and ``npu_swiglu`` use.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
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

    def candidates(self, module: nn.Module) -> Iterator[SwigluPatch]:
        """Every (gate, up, down, activation) assignment of the module's linear children that fits by shape.

        gate and up have the same shape, so both orders are yielded: only the numbers tell them apart.
        """
        linears = {n: m for n, m in module.named_children() if isinstance(m, nn.Linear)}
        acts = [n for n, m in module.named_children() if not isinstance(m, nn.Linear) and next(m.parameters(), None) is None]
        target = type(module).__name__
        for down, gate, up in itertools.permutations(linears, 3):
            d, g, u = linears[down], linears[gate], linears[up]
            if g.weight.shape == u.weight.shape and d.in_features == g.out_features and d.out_features == g.in_features:
                for act in acts:
                    yield SwigluPatch(op="swiglu", target=target, gate_proj=gate, up_proj=up, down_proj=down, act_attr=act)
