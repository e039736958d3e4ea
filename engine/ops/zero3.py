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

The head itself is read inside its own forward: the fused kernel runs as ``lm_head``'s forward
where ZeRO-3 partitions it (:mod:`engine.ops.sharded_head`), so the head's hooks gather it for the
kernel and again for its backward, and it is never registered with the root.
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
