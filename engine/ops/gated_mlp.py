"""What SwiGLU and GeGLU MLPs share: where the gate and up projections are, and binding.

A gated MLP computes ``down(act(gate(x)) * up(x))``. The kernel fuses only
``act(gate) * up``; the projections stay the module's own submodules and are called as
modules, so adapters wrapped around them (PEFT LoRA, quantized linears) keep working.
The projections come either as two linears (``gate_proj``, ``up_proj``: Llama, Qwen,
Gemma) or as one fused ``gate_up_proj`` whose output is split in halves (Phi-3, GLM,
GLM-4), with ``chunk_order`` saying which half is the gate.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import SignatureMismatch
from engine.ops.base import require_single_input
from engine.schema import GatedMlpPatch, GateUpOrder

__all__ = ["ACTIVATION_PROBE", "bind_gated_mlp", "check_gated_mlp", "projection_candidates"]

#: Inputs on which a target's activation module is compared with the op's activation. Device and dtype
#: explicit: made at import, which may happen inside ``with torch.device("meta")`` (a model built on the
#: meta device and patched there, transformers' from_pretrained), where a default-device probe would be a
#: meta tensor and every later check in the process would refuse the MLP.
ACTIVATION_PROBE = torch.linspace(-6, 6, 97, dtype=torch.float32, device="cpu")

#: The gated-MLP declarations an activation module may fit, as a refusal names them: when the
#: declared activation is not the target's, the one of these that is (bit for bit) is the fix.
ACTIVATION_DECLARATIONS: tuple[tuple[str, Callable[[torch.Tensor], torch.Tensor]], ...] = (
    ("op: swiglu", F.silu),
    ("op: geglu, approximate: tanh", partial(F.gelu, approximate="tanh")),
    ("op: geglu, approximate: none", F.gelu),
)


def _projection_names(patch: GatedMlpPatch) -> tuple[str, ...]:
    if patch.gate_up_proj is not None:
        return (patch.gate_up_proj, patch.down_proj)
    return (patch.gate_proj, patch.up_proj, patch.down_proj)


def check_gated_mlp(
    module: nn.Module,
    patch: GatedMlpPatch,
    op_name: str,
    activation: Callable[[torch.Tensor], torch.Tensor],
    activation_name: str,
) -> None:
    """Refuse a target whose forward, projections or activation are not what the op computes."""
    require_single_input(module, op_name)
    cls = type(module).__name__
    for attr in _projection_names(patch):
        if not isinstance(getattr(module, attr, None), nn.Module):
            children = ", ".join(name for name, _ in module.named_children()) or "none"
            fused = "" if patch.gate_up_proj is not None else (
                "; a fused gate and up projection is declared with gate_up_proj" if "gate_up_proj" in children else ""
            )
            raise SignatureMismatch(f"{cls} has no submodule {attr!r}; its submodules: {children}{fused}")
    if patch.gate_up_proj is not None:
        fused = getattr(module, patch.gate_up_proj)
        width = getattr(fused, "out_features", None)
        if isinstance(width, int) and width % 2:
            raise SignatureMismatch(
                f"{cls}.{patch.gate_up_proj} has {width} outputs, which cannot split into gate and up"
            )
    act = getattr(module, patch.act_attr, None)
    if not _computes(act, activation):
        found = type(act).__name__ if act is not None else f"missing (no attribute {patch.act_attr!r})"
        fits = [label for label, candidate in ACTIVATION_DECLARATIONS if _computes(act, candidate)]
        hint = f"{fits[0]} fits" if fits else "check the config's hidden_act, and act_attr"
        raise SignatureMismatch(
            f"{cls}.{patch.act_attr} is {found}, which does not compute {activation_name} exactly; "
            f"{op_name} replaces {activation_name}-gated MLPs only ({hint})"
        )


def _computes(act: Any, activation: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether ``act`` is ``activation`` bit for bit on :data:`ACTIVATION_PROBE`."""
    if not callable(act):
        return False
    with torch.no_grad():
        try:
            return torch.equal(act(ACTIVATION_PROBE), activation(ACTIVATION_PROBE))
        except Exception:  # an activation that cannot run on a probe is not the one we compute
            return False


def bind_gated_mlp(patch: GatedMlpPatch, impl: Callable[..., Any]) -> Callable[..., Any]:
    """``forward(self, x) = down(impl(gate, up))`` with the gate and up halves as declared."""
    down_name = patch.down_proj
    if patch.gate_up_proj is not None:
        fused_name = patch.gate_up_proj
        gate_first = patch.chunk_order is GateUpOrder.gate_up

        def fused_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
            modules = self._modules
            first, second = modules[fused_name](x).chunk(2, dim=-1)
            gate, up = (first, second) if gate_first else (second, first)
            return modules[down_name](impl(gate, up))

        return fused_forward
    gate_name, up_name = patch.gate_proj, patch.up_proj

    def forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        modules = self._modules
        return modules[down_name](impl(modules[gate_name](x), modules[up_name](x)))

    return forward


def projection_candidates(module: nn.Module) -> Iterator[dict[str, Any]]:
    """Every assignment of a module's linear children to gate/up/down (or fused gate_up/down)
    that fits by shape, with every parameterless child as the activation (for the scaffold).

    Gate and up have the same shape, and the halves of a fused projection too, so both
    orders are yielded: only the numbers tell them apart.
    """
    linears = {n: m for n, m in module.named_children() if isinstance(m, nn.Linear)}
    acts = [n for n, m in module.named_children()
            if not isinstance(m, nn.Linear) and next(m.parameters(), None) is None]
    for act in acts:
        for down, gate, up in itertools.permutations(linears, 3):
            d, g, u = linears[down], linears[gate], linears[up]
            if g.weight.shape == u.weight.shape and d.in_features == g.out_features and d.out_features == g.in_features:
                yield {"gate_proj": gate, "up_proj": up, "down_proj": down, "act_attr": act}
        for down, fused in itertools.permutations(linears, 2):
            d, f = linears[down], linears[fused]
            if f.out_features == 2 * d.in_features and f.in_features == d.out_features:
                for order in GateUpOrder:
                    yield {"gate_up_proj": fused, "chunk_order": order, "down_proj": down, "act_attr": act}
