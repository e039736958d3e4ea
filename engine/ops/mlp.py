"""An MLP without a gate: ``down(act(up(x)))``, biases in the projections.

The MLP of GPT-NeoX / Pythia (``dense_h_to_4h``, ``dense_4h_to_h``), Phi-1/2 (``fc1``,
``fc2``), StarCoder2 (``c_fc``, ``c_proj``, then dropout), Falcon, Nemotron-H (``relu2``)
and the BERT-likes and vision towers (CLIP's ``quick_gelu``, SigLIP's tanh GELU). As for the
gated MLPs, the projections stay the module's own submodules, called as modules (with their
biases, PEFT adapters, quantized linears); the kernel is the activation, ``impl(h) -> act(h)``,
which is what a vendor kernel replaces (``LigerReLUSquaredFunction``, ``torch_npu.npu_gelu``).

Each activation's reference is transformers' own expression (``ACT2FN``), step for step:
``gelu_new`` (Phi-1/2) is the tanh GELU written out and differs from ``F.gelu(approximate="tanh")``
in the last bits, so the two are different declarations. The target's activation module is
compared with the declared one on a probe, bit for bit, at plan time.

A forward that applies dropout to its output (StarCoder2's ``residual_dropout``) declares the
attribute holding the probability (``dropout_attr``): the patched forward applies the same
dropout, so training is what it was; a forward whose code calls dropout without the declaration
is refused (the dropout would silently be dropped).
"""

from __future__ import annotations

import inspect
import itertools
import math
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import SignatureMismatch
from engine.ops.base import ModuleOp, register_op, require_single_input
from engine.ops.gated_mlp import ACTIVATION_PROBE
from engine.schema import MlpActivation, MlpPatch

__all__ = ["ACTIVATIONS", "MlpOp", "activation_reference", "computes_exactly"]


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


#: Each activation as transformers' ``ACT2FN`` class computes it (activations.py, 5.25).
ACTIVATIONS: dict[MlpActivation, Callable[[torch.Tensor], torch.Tensor]] = {
    MlpActivation.gelu: F.gelu,
    MlpActivation.gelu_tanh: _gelu_tanh,
    MlpActivation.gelu_new: _gelu_new,
    MlpActivation.quick_gelu: _quick_gelu,
    MlpActivation.relu: F.relu,
    MlpActivation.relu2: _relu2,
    MlpActivation.silu: F.silu,
}


def activation_reference(activation: MlpActivation) -> Callable[[torch.Tensor], torch.Tensor]:
    """The ground truth of the ``mlp`` kernel for ``activation``: ``act(h)``."""
    return ACTIVATIONS[activation]


def computes_exactly(act: Any, activation: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """Whether the module ``act`` is ``activation`` bit for bit on the probe (fp32 and bf16)."""
    if not callable(act):
        return False
    try:
        with torch.no_grad():
            return all(
                torch.equal(act(probe), activation(probe))
                for probe in (ACTIVATION_PROBE, ACTIVATION_PROBE.to(torch.bfloat16))
            )
    except Exception:  # noqa: BLE001  (an activation that cannot run on a probe is not the one we compute)
        return False


def _source(module: nn.Module) -> str:
    try:
        return textwrap.dedent(inspect.getsource(inspect.unwrap(type(module).forward)))
    except (OSError, TypeError):
        return ""


def _calls_dropout(module: nn.Module) -> bool:
    """Whether the forward's code applies dropout (read, not run: in eval mode it would not show)."""
    return "dropout" in _source(module)


def _linears(module: nn.Module) -> dict[str, nn.Linear]:
    return {n: m for n, m in module.named_children() if isinstance(m, nn.Linear)}


@register_op
class MlpOp(ModuleOp):
    """Replace an ungated MLP's forward with ``down(kernel(up(x)))`` (then its dropout, if declared)."""

    name = "mlp"
    patch_type = MlpPatch
    declared_settings = ("activation", "up_proj", "down_proj", "act_attr")

    def reference(self, patch: MlpPatch) -> Callable[..., Any]:
        return activation_reference(patch.activation)

    def check_target(self, module: nn.Module, patch: MlpPatch) -> None:
        require_single_input(module, self.name)
        cls = type(module).__name__
        for attr in (patch.up_proj, patch.down_proj):
            if not isinstance(getattr(module, attr, None), nn.Module):
                children = ", ".join(name for name, _ in module.named_children()) or "none"
                raise SignatureMismatch(f"{cls} has no submodule {attr!r}; its submodules: {children}")
        up, down = getattr(module, patch.up_proj), getattr(module, patch.down_proj)
        # down(act(up(x))) needs the two to chain, nothing more: a projector maps one width to another (LLaVA's
        # vision 32 -> text 64), measured on a tiny copy where both widths happened to agree
        if isinstance(up, nn.Linear) and isinstance(down, nn.Linear) and up.out_features != down.in_features:
            raise SignatureMismatch(
                f"{cls}.{patch.up_proj} ({up.in_features} -> {up.out_features}) and {patch.down_proj} "
                f"({down.in_features} -> {down.out_features}) do not chain as up then down"
            )
        act = getattr(module, patch.act_attr, None)
        if not computes_exactly(act, ACTIVATIONS[patch.activation]):
            found = type(act).__name__ if act is not None else f"missing (no attribute {patch.act_attr!r})"
            fits = [a.value for a, f in ACTIVATIONS.items() if computes_exactly(act, f)]
            hint = f"activation: {fits[0]} fits" if fits else "check the config's hidden_act, and act_attr"
            raise SignatureMismatch(
                f"{cls}.{patch.act_attr} is {found}, which does not compute {patch.activation.value} exactly ({hint})"
            )
        if patch.dropout_attr is not None:
            p = getattr(module, patch.dropout_attr, None)
            if not isinstance(p, (float, int)) or isinstance(p, bool) or not 0 <= p < 1:
                raise SignatureMismatch(f"{cls}.{patch.dropout_attr} is not a dropout probability (dropout_attr)")
        elif _calls_dropout(module):
            floats = [k for k, v in vars(module).items() if isinstance(v, float) and not k.startswith("_")]
            raise SignatureMismatch(
                f"{cls}.forward applies dropout, which the mlp op would drop; declare dropout_attr "
                f"(the attribute holding its probability{': ' + ', '.join(floats) if floats else ''})"
            )

    def bind(self, module: nn.Module, patch: MlpPatch, impl: Callable[..., Any]) -> Callable[..., Any]:
        up_name, down_name, dropout_attr = patch.up_proj, patch.down_proj, patch.dropout_attr
        if dropout_attr is None:

            def forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
                modules = self._modules
                return modules[down_name](impl(modules[up_name](hidden_states)))

            return forward

        def dropout_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
            modules = self._modules
            out = modules[down_name](impl(modules[up_name](hidden_states)))
            return F.dropout(out, p=getattr(self, dropout_attr), training=self.training)

        return dropout_forward

    def alternatives(self, patch: MlpPatch) -> Iterator[tuple[str, MlpPatch]]:
        for activation in MlpActivation:
            if activation is not patch.activation:
                yield f"activation: {activation.value}", patch.model_copy(update={"activation": activation})

    def candidates(self, module: nn.Module) -> Iterator[MlpPatch]:
        """Every (up, down) pair of linear children that chains by shape, with every parameterless
        child as the activation and each activation it computes bit for bit on the probe."""
        linears = _linears(module)
        if len(linears) != 2:  # a gated MLP has three (or a fused gate_up): not this op
            return
        acts = [n for n, m in module.named_children()
                if not isinstance(m, nn.Linear) and next(m.parameters(), None) is None]
        dropouts: list[str | None] = [None]
        if _calls_dropout(module):
            dropouts = [k for k, v in vars(module).items()
                        if isinstance(v, float) and not isinstance(v, bool) and not k.startswith("_") and 0 <= v < 1]
        target = type(module).__name__
        for (up, down), act in itertools.product(itertools.permutations(linears, 2), acts):
            u, d = linears[up], linears[down]
            if u.out_features != d.in_features or u.in_features != d.out_features:
                continue  # both orders of a chaining pair are yielded: only running them tells which is up
            for activation, function in ACTIVATIONS.items():
                if not computes_exactly(getattr(module, act), function):
                    continue
                for dropout_attr in dropouts:
                    yield MlpPatch(op="mlp", target=target, activation=activation, up_proj=up, down_proj=down,
                                   act_attr=act, dropout_attr=dropout_attr)
