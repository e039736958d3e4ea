"""DeepSpeed ZeRO-3 partitioned parameters: look at one without gathering it.

Why: ZeRO-3 gathers a partitioned parameter that is read outside its own module's forward and
registers it as an *external parameter* of the module whose forward is running; from then on it
gathers it whenever that module's forward (and backward) starts. The fused head must compare
``embed_tokens.weight`` with ``lm_head.weight`` (are they tied?) before the backbone runs: by
DeepSpeed's getter (``ZeROOrderedDict.__getitem__``), a plain attribute read there of a parameter
not gathered at that moment (no prefetch) gathers it and registers it with the root model, which
for an untied input embedding (``[V, H]``, as large as the head) would keep it gathered for the
root's whole forward and backward, for nothing. :func:`peek` reads the parameter object without
DeepSpeed's getter.

The head itself is read where the kernel needs it, and ZeRO-3 gathers it then; it is registered
with the root model, so from the second step on it is gathered when the root's forward starts
(benchmarks/deepspeed_zero3.py measures what that costs). Gathering it only around the kernel
(``deepspeed.zero.GatheredParameters``) was tried: the head's gradient, computed in the forward,
then reaches a parameter that is partitioned again by the backward, which DeepSpeed's gradient
hooks reject (a size mismatch in ``backward``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["peek"]


def peek(module: Any, name: str) -> Any:
    """``getattr(module, name, None)``, without ZeRO-3 gathering (and registering) a partitioned parameter.

    ZeRO-3 swaps ``module._parameters`` for a dict whose ``__getitem__`` gathers; ``dict.get`` does not call it.
    """
    params = module.__dict__.get("_parameters") if isinstance(module, nn.Module) else None
    if params is not None and name in params:
        return dict.get(params, name)
    return getattr(module, name, None)
