"""Tiny transformers models built from a config alone, with weights perturbed away from init.

Why perturb: a fresh norm weight is all ones (or all zeros for ``1 + w`` norms), where
``w`` and ``1 + w`` or two cast orders can coincide; a test on fresh weights proves little.
Every parameter is moved by a random amount *away* from its init value (never landing on
exactly 0 or 1), so norm weights end up around 1 for ``weight`` norms and around 0 for
``one_plus_weight`` norms, as in trained models.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["build_tiny_model", "perturb_", "tiny_config_kwargs"]

#: Keyword arguments every tiny model starts from; a patchset's ``tiny_model.config`` adds to them.
BASE_KWARGS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


def tiny_config_kwargs(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    return {**BASE_KWARGS, **(overrides or {})}


def perturb_(model: nn.Module, *, seed: int = 0, scale: float = 0.2) -> nn.Module:
    """Move every floating parameter away from its value by ``+-[scale/4, scale]`` (in place)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point():
                continue
            magnitude = torch.empty(p.shape).uniform_(scale / 4, scale, generator=gen)
            sign = torch.randint(0, 2, p.shape, generator=gen) * 2 - 1
            p.add_((magnitude * sign).to(p.dtype))
    return model


def build_tiny_model(
    model_type: str,
    config: dict[str, Any] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    perturb: bool = True,
    attn_implementation: str | None = "eager",
) -> nn.Module:
    """A causal LM of ``model_type`` with the tiny base sizes plus ``config`` overrides."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    kwargs = tiny_config_kwargs(config)
    cfg = AutoConfig.for_model(model_type, **kwargs)
    if attn_implementation is not None:
        cfg._attn_implementation = attn_implementation
    model = AutoModelForCausalLM.from_config(cfg)
    if perturb:
        perturb_(model, seed=seed)
    return model.to(dtype)
