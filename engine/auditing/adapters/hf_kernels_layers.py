"""The layers ``--with hf-kernels`` maps, resolved from installed packages instead of the hub.

transformers maps the layer name ``RMSNorm`` (every class it decorates with
``@use_kernel_forward_from_hub("RMSNorm")``) to ``kernels-community/liger-kernels``'s
``LigerRMSNorm`` for training on CUDA. That hub build is Liger's RMSNorm function in a stateless
layer (no ``__init__``: ``kernels`` refuses layers that add state) reading the decorated module's
``weight`` and ``variance_epsilon``, with Liger's defaults: no offset, casting mode ``llama``,
in place. Here the same layer calls the installed liger-kernel's ``LigerRMSNormFunction``, so
nothing is downloaded; its Triton kernel runs under Triton's interpreter on a CPU.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["LigerRMSNorm"]


class LigerRMSNorm(nn.Module):
    """``kernels-community/liger-kernels`` ``layers.LigerRMSNorm``: Liger's RMSNorm with its defaults."""

    weight: torch.Tensor
    variance_epsilon: float

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        from liger_kernel.ops import LigerRMSNormFunction

        return LigerRMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon, 0.0, "llama", True, None)
