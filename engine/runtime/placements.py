"""Where a target's parameters live across processes: DTensors of tensor parallelism.

Why: a vendor kernel (Triton, CANN) is handed raw local memory; given a ``DTensor`` it fails
or, worse, computes on the local shard as if it were the whole tensor (Liger's kernels
failed on DTensor under TP for months). Providers declare whether they take DTensor inputs
(``KernelProvider.dtensor``); the planner asks this module whether a target has DTensor
parameters and, if so, passes over (``auto``) or refuses (explicit) the providers that don't.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["dtensor_parameter"]


def dtensor_parameter(model: nn.Module, matches: list[tuple[str, nn.Module]]) -> str | None:
    """The first DTensor parameter of the matched modules, described with its placements; else None.

    All parameters of a target's subtree count, even those only its children read (a
    conservative choice: a swiglu MLP under TP passes its projections' DTensor weights to no
    kernel, but an ``lm_head`` target does). Parameters FSDP2 alone shards (a 1-D mesh under a
    ``fully_shard`` module) are exempt: FSDP2 gathers them into plain tensors before the forward.
    """
    if not torch.distributed.is_available():
        return None
    from torch.distributed.tensor import DTensor

    fsdp_paths = _fsdp_managed_paths(model)
    for path, module in matches:
        under_fsdp = any(p == "" or path == p or path.startswith(p + ".") for p in fsdp_paths)
        for name, param in module.named_parameters():
            if isinstance(param, DTensor) and not (under_fsdp and param.device_mesh.ndim == 1):
                return (f"{path} ({type(module).__name__}) has DTensor parameter {name!r} "
                        f"with placements {tuple(param.placements)}")
    return None


def _fsdp_managed_paths(model: nn.Module) -> list[str]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [path for path, module in model.named_modules() if isinstance(module, FSDPModule)]
