"""A norm patch that guesses ``1 + weight`` from the weights, as fine-tuning stacks once did: audit it.

The guess (an older twinkle kernel map's, and seed 001's Qwen3-8B incident): a norm whose weight
has ``abs(mean) < 0.3`` is taken for a zero-centred ``(1 + w)`` norm, any other for a plain ``w``
norm. Values change with training and both kinds exist; on trained Qwen3-8B 18 of 145 norms have
means near 0.011 and were scaled by ``1.011`` instead of ``0.011`` (loss 4.69 -> 8.83). Written here
from that description, the way such a patch is written (a fused-kernel-style forward on each
instance), so that ``patch-engine audit`` can show what it computes on a real checkpoint:

    patch-engine audit --gguf gemma-3-270m.gguf --with examples/audit_weight_mean_guess.py:apply

The forward normalizes in fp32 and multiplies by the guessed scale in fp32, casting last: the
kernel's arithmetic is right, only the guess is not.
"""

from __future__ import annotations

import types

import torch
from torch import nn

#: The guess: ``abs(weight.mean())`` below this means ``1 + weight``.
THRESHOLD = 0.3


def _rms_norm_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    dtype = hidden_states.dtype
    x = hidden_states.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self._guessed_eps)
    scale = self.weight.float() + 1.0 if self._guessed_one_plus else self.weight.float()
    return (x * scale).to(dtype)


def apply(model: nn.Module) -> nn.Module:
    """Patch every module whose class name has ``RMSNorm`` (and a 1-d weight), guessing its scale from the weights."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if "RMSNorm" not in type(module).__name__ or not isinstance(weight, torch.Tensor) or weight.dim() != 1:
            continue
        module._guessed_eps = getattr(module, "variance_epsilon", None) or getattr(module, "eps", 1e-6)
        module._guessed_one_plus = bool(weight.detach().float().mean().abs() < THRESHOLD)
        module.forward = types.MethodType(_rms_norm_forward, module)
    return model
