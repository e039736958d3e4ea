"""The fp64 truth one decoder layer at a time: each layer's activations are recomputed in its backward.

Why: the truth's activations are fp64, twice a training step's in an fp32 model and four times
in bf16, and they dominated verification's peak (SmolLM2-135M fp32, 2 x 160 tokens: 1.3 GiB
over the truth's start, against a step's 0.8 GiB). Here each decoder layer runs without a
graph in the forward, keeping only its inputs (the hidden states entering it, in fp64); its
backward re-runs the layer in the fp64 mode with a graph and back-propagates through it at
once. So the truth holds the hidden states between layers plus one layer's fp64 activations,
at the price of one more fp64 forward. This is gradient checkpointing, done here because
transformers' own runs the recomputation outside the fp64 mode (see ``_no_checkpointing`` in
:mod:`engine.verification.models`); the values are those of the plain truth (the same fp64
operations on the same inputs, dropout drawing the same numbers from the saved RNG state).

Which modules: transformers' decoder layers (``GradientCheckpointingLayer`` instances, the
same ones its gradient checkpointing recomputes), the outermost where they nest. A layer
called with a cache object runs as it is: recomputing would update the cache twice.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import get_device_states, set_device_states

from engine.verification.compare import is_cache
from engine.verification.truth import Fp64

__all__ = ["recomputed_layers"]


def _layers(model: nn.Module) -> list[nn.Module]:
    """The outermost decoder layers of ``model`` (none if transformers does not mark them)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # an older transformers: the truth keeps every activation, as before
        return []
    out: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if isinstance(module, GradientCheckpointingLayer):
            out.append(module)
            inside.update(id(m) for m in module.modules())
    return out


@contextlib.contextmanager
def recomputed_layers(model: nn.Module, mode: Fp64) -> Iterator[int]:
    """While the block runs, ``model``'s decoder layers are recomputed in their backward (yields how many)."""
    layers = _layers(model)
    saved = [(layer, layer.__dict__.get("forward")) for layer in layers]
    for layer in layers:
        layer.forward = functools.partial(_checkpointed, mode, layer.forward)
    try:
        yield len(layers)
    finally:
        for layer, own in saved:
            if own is None:
                del layer.forward
            else:
                layer.forward = own


def _checkpointed(mode: Fp64, forward: Any, *args: Any, **kwargs: Any) -> Any:
    leaves, spec = tree_flatten((args, kwargs))
    if mode.sink is None or not torch.is_grad_enabled() or mode.recomputing or any(map(is_cache, leaves)):
        return forward(*args, **kwargs)
    where = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    if not any(leaves[i].requires_grad for i in where):
        return forward(*args, **kwargs)
    shape: dict[str, Any] = {}

    def run(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values = list(leaves)
        for i, t in zip(where, tensors, strict=True):
            values[i] = t
        a, k = tree_unflatten(values, spec)
        outs, shape["spec"] = tree_flatten(forward(*a, **k))
        shape["outs"] = outs
        shape["where"] = [i for i, v in enumerate(outs) if isinstance(v, torch.Tensor)]
        return tuple(outs[i] for i in shape["where"])

    tensors = _Recompute.apply(mode, run, *(leaves[i] for i in where))
    outs = list(shape["outs"])
    for i, t in zip(shape["where"], tensors, strict=True):
        outs[i] = t
    return tree_unflatten(outs, shape["spec"])


class _Recompute(torch.autograd.Function):
    """Forward without a graph (uses counted for the sink); backward: the layer again, with one, back-propagated."""

    @staticmethod
    def forward(ctx: Any, mode: Fp64, run: Any, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.mode, ctx.run = mode, run
        ctx.grads = [t.requires_grad for t in tensors]
        ctx.cpu_rng = torch.get_rng_state()
        ctx.devices, ctx.device_rng = get_device_states(*tensors)
        ctx.save_for_backward(*tensors)
        counting, mode.counting = mode.counting, True
        try:
            with torch.no_grad():
                return tuple(t.detach() for t in run(*tensors))
        finally:
            mode.counting = counting

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        mode: Fp64 = ctx.mode
        inputs = [t.detach().requires_grad_(g) for t, g in zip(ctx.saved_tensors, ctx.grads, strict=True)]
        recomputing, mode.recomputing = mode.recomputing, True
        try:
            with torch.random.fork_rng(devices=list(ctx.devices)), torch.enable_grad(), mode.scope():
                torch.set_rng_state(ctx.cpu_rng)
                set_device_states(ctx.devices, ctx.device_rng)
                outs = ctx.run(*inputs)
            pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if o.requires_grad and g is not None]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        finally:
            mode.recomputing = recomputing
        return (None, None, *(t.grad if g else None for t, g in zip(inputs, ctx.grads, strict=True)))
