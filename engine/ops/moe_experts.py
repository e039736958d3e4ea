"""MoE experts: ``forward(hidden_states, top_k_index, top_k_weights)`` over 3-D expert weights.

transformers 5 stores the routed experts of an MoE block as one module with fused 3-D
parameters (``Qwen3MoeExperts``: ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]) and
decorates its class with ``use_experts_implementation``, whose forward dispatches on
``config._experts_implementation`` (``eager``, ``grouped_mm`` (the default), ``batched_mm``).
The ground truth of this op is the class's own *eager* forward (the undecorated one), for
each routed (token, slot) pair::

    gu  = x @ gate_up_e^T (+ bias)        # x @ gate_up_e when the weights are stored transposed
    h   = act(gate) * up                  # gate/up: halves (concatenated) or even/odd (interleaved)
    out = (h @ down_e^T (+ bias)) * top_k_weights[token, slot]
    y[token] += out                       # in the input dtype, experts in ascending order

``act`` is the module's own activation (``act_fn = ACT2FN[config.hidden_act]``), declared by name
(``silu`` for most MoEs; ``gelu`` ... ``relu2``, the names and expressions of the ``mlp`` op, for
a config that sets another ``hidden_act``, as transformers' testers do) and checked bit for bit.
gpt_oss gates with a clamped swiglu: ``g = min(gate, limit)``, ``u = clamp(up, -limit, limit)``,
``h = (u + 1) * g * sigmoid(alpha * g)``. An expert index equal to the number of experts is
the expert-parallel sentinel: it contributes nothing, as in transformers.

The patched forward replaces the dispatcher on the instance, standing in for transformers'
default implementation (``grouped_mm``; ``eager`` for a class that cannot switch). A choice
the user made is honoured, never silently overridden: experts whose config names another
implementation at plan time are left as they are (skipped, with the reason in the plan), and
a patched module whose config is switched after apply (``model.set_experts_implementation``)
runs transformers' dispatcher, i.e. the implementation chosen, from the first forward that sees
the switch on: switching back to ``grouped_mm`` is a choice too, honoured (transformers' own
``grouped_mm`` runs; apply again after a revert to get the kernel back). A switch made and undone
with no forward in between is not seen (the config then holds the value the kernel stands in for). The layout is declared in the YAML
and checked at plan time against the weights' shapes and the flags the decorator sets
(``is_transposed``, ``is_concatenated``, ``has_bias``, ``has_gate``, ``has_post_expert_norm``).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import SignatureMismatch
from engine.ops.base import ModuleOp, describe_signature, forward_parameters, register_op
from engine.ops.mlp import ACTIVATIONS, computes_exactly
from engine.schema import ExpertsActivation, ExpertsLayout, MlpActivation, MoeExpertsPatch

__all__ = ["MoeExpertsOp", "apply_gate", "expert_weights", "moe_experts_reference"]

#: ``act`` of each ``act(gate) * up`` gating, as the mlp op computes it (transformers' ACT2FN expressions).
GATE_ACTIVATIONS: dict[ExpertsActivation, Callable[[torch.Tensor], torch.Tensor]] = {
    a: ACTIVATIONS[MlpActivation(a.value)] for a in ExpertsActivation if a is not ExpertsActivation.clamped_swiglu
}

#: The kernel signature every provider of ``moe_experts`` returns from ``build(patch)``.
ExpertsKernel = Callable[..., torch.Tensor]


def apply_gate(
    gate_up: torch.Tensor, layout: ExpertsLayout, activation: ExpertsActivation,
    alpha: float | None = None, limit: float | None = None,
) -> torch.Tensor:
    """``h = f(gate, up)`` from the fused gate_up output, with transformers' expressions."""
    if layout is ExpertsLayout.concatenated:
        gate, up = gate_up.chunk(2, dim=-1)
    else:
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    if activation is not ExpertsActivation.clamped_swiglu:
        return GATE_ACTIVATIONS[activation](gate) * up
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)  # type: ignore[operator]
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def _project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    out = x @ weight if transposed else F.linear(x, weight)
    return out if bias is None else out + bias


def moe_experts_reference(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    alpha: float | None = None,
    limit: float | None = None,
    *,
    layout: ExpertsLayout = ExpertsLayout.concatenated,
    transposed: bool = False,
    activation: ExpertsActivation = ExpertsActivation.silu,
) -> torch.Tensor:
    """The ground truth: transformers' eager experts loop, step for step (bit-equal to it)."""
    num_experts = gate_up.shape[0]
    final = torch.zeros_like(hidden_states)
    with torch.no_grad():
        expert_mask = F.one_hot(top_k_index, num_classes=num_experts + 1).permute(2, 1, 0)
        expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
    for expert in expert_hit:
        e = expert[0]
        if e == num_experts:  # expert-parallel sentinel
            continue
        top_k_pos, token_idx = torch.where(expert_mask[e])
        gate_up_out = _project(hidden_states[token_idx], gate_up[e], None if gate_up_bias is None else gate_up_bias[e],
                               transposed)
        h = apply_gate(gate_up_out, layout, activation, alpha, limit)
        out = _project(h, down[e], None if down_bias is None else down_bias[e], transposed)
        out = out * top_k_weights[token_idx, top_k_pos, None]
        final.index_add_(0, token_idx, out.to(final.dtype))
    return final


def expert_weights(module: nn.Module, patch: MoeExpertsPatch) -> dict[str, Any]:
    """The kernel's weight arguments read off ``module`` at call time (``gate_up`` ... ``limit``)."""
    clamped = patch.activation is ExpertsActivation.clamped_swiglu
    return {
        "gate_up": getattr(module, patch.gate_up_proj),
        "down": getattr(module, patch.down_proj),
        "gate_up_bias": getattr(module, patch.gate_up_bias) if patch.gate_up_bias else None,
        "down_bias": getattr(module, patch.down_bias) if patch.down_bias else None,
        "alpha": float(getattr(module, patch.alpha_attr)) if clamped else None,
        "limit": float(getattr(module, patch.limit_attr)) if clamped else None,
    }


#: transformers' decorator flags and the declaration each must agree with.
_FLAG_CHECKS: tuple[tuple[str, Callable[[MoeExpertsPatch], Any], str], ...] = (
    ("is_transposed", lambda p: p.transposed, "transposed"),
    ("is_concatenated", lambda p: p.layout is ExpertsLayout.concatenated, "layout"),
    ("has_bias", lambda p: bool(p.gate_up_bias or p.down_bias), "gate_up_bias/down_bias"),
)


@register_op
class MoeExpertsOp(ModuleOp):
    """Replace an experts module's forward with one kernel call over its 3-D weights."""

    name = "moe_experts"
    patch_type = MoeExpertsPatch
    reference_description = "torch reference: transformers' eager experts loop (the ground truth), every device"

    def reference(self, patch: MoeExpertsPatch) -> ExpertsKernel:
        """The torch kernel: transformers' eager loop with the declared layout and activation."""
        return partial(moe_experts_reference, layout=patch.layout, transposed=patch.transposed,
                       activation=patch.activation)

    def ground_truth(self, module: nn.Module) -> Callable[..., Any]:
        """transformers' eager experts forward, under the decorator that dispatches on the config."""
        return inspect.unwrap(type(module).forward)

    def check_target(self, module: nn.Module, patch: MoeExpertsPatch) -> None:
        cls = type(module).__name__
        params = forward_parameters(type(module))
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        required = [p for p in positional if p.default is inspect.Parameter.empty]
        if len(positional) != 3 or len(required) > 3:
            raise SignatureMismatch(
                f"moe_experts cannot replace {describe_signature(type(module))}: it replaces "
                "forward(hidden_states, top_k_index, top_k_weights) (transformers' experts modules); "
                "patch the block's dense MLPs with swiglu instead"
            )
        for flag, refuse in (("has_gate", False), ("has_post_expert_norm", True)):
            if getattr(module, flag, not refuse) is refuse:
                what = "ungated experts (no gate_up_proj)" if flag == "has_gate" else "a norm after each expert"
                raise SignatureMismatch(f"{cls} has {flag}={refuse}: {what}, which moe_experts does not compute")
        for flag, declared, key in _FLAG_CHECKS:
            actual = getattr(module, flag, None)
            if isinstance(actual, bool) and actual != declared(patch):
                raise SignatureMismatch(
                    f"{cls}.{flag} is {actual} (set by transformers' use_experts_implementation), but the "
                    f"patch declares {key}: {_declared_text(patch, key)}; declare {_fix(flag, actual)}"
                )
        self._check_shapes(module, patch)
        self._check_activation(module, patch)

    def _check_shapes(self, module: nn.Module, patch: MoeExpertsPatch) -> None:
        cls = type(module).__name__
        tensors = {}
        for key in ("gate_up_proj", "down_proj", "gate_up_bias", "down_bias"):
            attr = getattr(patch, key)
            if attr is None:
                continue
            value = getattr(module, attr, None)
            want = 3 if key.endswith("proj") else 2
            if not isinstance(value, torch.Tensor) or value.dim() != want:
                found = ", ".join(n for n, p in module.named_parameters(recurse=False) if p.dim() == want) or "none"
                raise SignatureMismatch(f"{cls} has no {want}-D tensor {attr!r} ({key}); its {want}-D parameters: {found}")
            tensors[key] = value
        gate_up, down = tensors["gate_up_proj"], tensors["down_proj"]
        experts = gate_up.shape[0]
        if patch.transposed:
            hidden, two_i = gate_up.shape[1], gate_up.shape[2]
            down_expected = (experts, two_i // 2, hidden)
        else:
            two_i, hidden = gate_up.shape[1], gate_up.shape[2]
            down_expected = (experts, hidden, two_i // 2)
        if two_i % 2 or tuple(down.shape) != down_expected:
            order = "[E, in, out]" if patch.transposed else "[E, out, in]"
            raise SignatureMismatch(
                f"{cls}: {patch.gate_up_proj} {tuple(gate_up.shape)} and {patch.down_proj} {tuple(down.shape)} are not "
                f"the shapes of gated experts stored {order} (transposed: {patch.transposed}); expected "
                f"{patch.down_proj} {down_expected}. Check transposed and the parameter names"
            )
        for key, size in (("gate_up_bias", two_i), ("down_bias", hidden)):
            if key in tensors and tuple(tensors[key].shape) != (experts, size):
                raise SignatureMismatch(f"{cls}.{getattr(patch, key)} has shape {tuple(tensors[key].shape)}, "
                                        f"expected {(experts, size)} ({key})")
        undeclared = [n for n, p in module.named_parameters(recurse=False)
                      if p.dim() == 2 and n not in (patch.gate_up_bias, patch.down_bias)]
        if undeclared:
            raise SignatureMismatch(f"{cls} has parameters {', '.join(undeclared)} that the patch does not declare "
                                    "(gate_up_bias / down_bias): the patched forward would ignore them")

    def _check_activation(self, module: nn.Module, patch: MoeExpertsPatch) -> None:
        cls = type(module).__name__
        if patch.activation is ExpertsActivation.clamped_swiglu:
            for key in ("alpha_attr", "limit_attr"):
                value = getattr(module, getattr(patch, key), None)
                if not _is_number(value):
                    raise SignatureMismatch(f"{cls} has no numeric attribute {getattr(patch, key)!r} ({key}), "
                                            "which activation clamped_swiglu needs")
            return
        act = getattr(module, patch.act_attr, None)
        if not computes_exactly(act, GATE_ACTIVATIONS[patch.activation]):
            raise SignatureMismatch(f"{cls}.{patch.act_attr} is {_activation_name(module, act)}, which does not "
                                    f"compute {patch.activation.value} exactly; {_activation_fix(act)}")

    def users_choice(self, model: nn.Module, module: nn.Module) -> str | None:
        """The experts implementation the user chose, if it is not transformers' default (which the patch replaces)."""
        chosen = _implementation(module)
        default = _default_implementation(model)
        if chosen is None or chosen == default:
            return None
        return (f"config._experts_implementation is {chosen!r}, chosen by the user (the default is {default!r}): "
                "honoured, left to transformers' dispatcher; to patch these experts, load the model without "
                f"experts_implementation= or call model.set_experts_implementation({default!r}) before apply")

    def bind(self, module: nn.Module, patch: MoeExpertsPatch, impl: ExpertsKernel) -> Callable[..., Any]:
        names = [p.name for p in forward_parameters(type(module))[:3]]
        applied = _implementation(module)  # what the kernel stands in for; another value later is a user's switch
        dispatch = type(module).forward
        chose = [False]  # once a switch is seen, every later choice is the user's, grouped_mm included

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
            if chose[0] or (applied is not None and _implementation(self) != applied):
                chose[0] = True
                return dispatch(self, *args, **kwargs)  # switched after apply: honour it
            if kwargs or len(args) != 3:
                bound = inspect.signature(type(self).forward).bind(self, *args, **kwargs)
                args = tuple(bound.arguments[n] for n in names)
            return impl(*args, **expert_weights(self, patch))

        forward.__signature__ = inspect.signature(inspect.unwrap(type(module).forward))  # type: ignore[attr-defined]
        return forward

    def candidates(self, module: nn.Module) -> Iterator[MoeExpertsPatch]:
        """Every naming of the 3-D weights and 2-D biases, layout and storage order, with each activation it computes.

        Why all of them: ``concatenated`` and ``interleaved`` have the same shapes, and only
        the numbers tell them apart (the scaffold measures each; check_target drops the rest).
        What is read off the module rather than tried: the flags transformers' decorator sets
        (a layout or storage order they contradict is refused anyway, and its refusal would hide
        the one that matters), and which activation its ``act_fn`` computes, bit for bit on a probe.
        """
        weights = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 3]
        biases = [n for n, p in module.named_parameters(recurse=False) if p.dim() == 2]
        if len(weights) < 2:
            return
        activations = _activation_candidates(module)
        bias_pairs = [(g, d) for g in [None, *biases] for d in [None, *biases] if g is None or g != d]
        flags = {f: getattr(module, f, None) for f in ("is_transposed", "is_concatenated", "has_bias")}
        layouts = [v for v in ExpertsLayout if not isinstance(flags["is_concatenated"], bool)
                   or flags["is_concatenated"] == (v is ExpertsLayout.concatenated)]
        storages = [t for t in (False, True)
                    if not isinstance(flags["is_transposed"], bool) or flags["is_transposed"] == t]
        if isinstance(flags["has_bias"], bool):
            bias_pairs = [b for b in bias_pairs if any(b) == flags["has_bias"]]
        target = type(module).__name__
        for gate_up, down in itertools.permutations(weights, 2):
            for (g_bias, d_bias), layout, transposed, act in itertools.product(
                bias_pairs, layouts, storages, activations
            ):
                yield MoeExpertsPatch(
                    op="moe_experts", target=target, gate_up_proj=gate_up, down_proj=down, gate_up_bias=g_bias,
                    down_bias=d_bias, layout=layout, transposed=transposed, **act,
                )

    def alternatives(self, patch: MoeExpertsPatch) -> Iterator[tuple[str, MoeExpertsPatch]]:
        other = next(v for v in ExpertsLayout if v is not patch.layout)
        yield f"layout: {other.value}", patch.model_copy(update={"layout": other})


def _activation_candidates(module: nn.Module) -> list[dict[str, Any]]:
    """The activation settings to measure: ``act(gate) * up`` for each activation a parameterless child computes
    bit for bit; the clamped swiglu for each pair of numeric attributes ``PREFIXalpha`` and ``PREFIXlimit``
    (gpt_oss: ``alpha``, ``limit``; MiniMax-M3: ``swiglu_alpha``, ``swiglu_limit``). Where none fits, the
    silu declaration alone, whose refusal names the module's activation."""
    acts = [n for n, m in module.named_children() if next(m.parameters(), None) is None] or ["act_fn"]
    found: list[dict[str, Any]] = [{"activation": a, "act_attr": n} for n in acts for a, f in GATE_ACTIVATIONS.items()
                                   if computes_exactly(getattr(module, n, None), f)]
    numbers = sorted(k for k, v in vars(module).items() if not k.startswith("_") and _is_number(v))
    found += [{"activation": ExpertsActivation.clamped_swiglu, "alpha_attr": a, "limit_attr": lim}
              for a in numbers if a.endswith("alpha") for lim in numbers if lim == a.removesuffix("alpha") + "limit"]
    return found or [{"activation": ExpertsActivation.silu, "act_attr": acts[0]}]


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _activation_name(module: nn.Module, act: Any) -> str:
    """``GELUActivation (hidden_act 'gelu')``: the module's activation as the user configured it."""
    if act is None:
        return "missing (no such attribute)"
    hidden_act = getattr(getattr(module, "config", None), "hidden_act", None)
    return type(act).__name__ + (f" (hidden_act {hidden_act!r})" if isinstance(hidden_act, str) else "")


def _activation_fix(act: Any) -> str:
    """The declaration that computes ``act``, or why no moe_experts declaration does."""
    if act is None:
        return "declare act_attr (the attribute holding the activation), or clamped_swiglu (gpt_oss's experts)"
    fits = [a.value for a, f in GATE_ACTIVATIONS.items() if computes_exactly(act, f)]
    if fits:
        return f"declare activation: {fits[0]}"
    names = ", ".join(a.value for a in GATE_ACTIVATIONS)
    return (f"moe_experts computes act(gate) * up for {names} (bit for bit, as transformers' ACT2FN) or "
            "gpt_oss's clamped_swiglu, none of which is this activation: these experts stay unpatched")


def _implementation(module: nn.Module) -> str | None:
    """``config._experts_implementation`` of an experts module (transformers' decorator sets ``self.config``)."""
    return getattr(getattr(module, "config", None), "_experts_implementation", None)


def _default_implementation(model: nn.Module) -> str:
    """What transformers picks when the user names no experts implementation (``grouped_mm``, else ``eager``)."""
    pick = getattr(model, "get_correct_experts_implementation", None)
    try:
        return pick(None) if pick is not None else "grouped_mm"
    except (ValueError, ImportError):
        return "grouped_mm"


def _declared_text(patch: MoeExpertsPatch, key: str) -> str:
    if key == "layout":
        return patch.layout.value
    if key == "transposed":
        return str(patch.transposed).lower()
    return f"{patch.gate_up_bias} / {patch.down_bias}"


def _fix(flag: str, actual: bool) -> str:
    if flag == "is_transposed":
        return f"transposed: {str(actual).lower()}"
    if flag == "is_concatenated":
        return f"layout: {'concatenated' if actual else 'interleaved'}"
    return "gate_up_bias and down_bias (e.g. gate_up_proj_bias, down_proj_bias)" if actual else "no biases"

