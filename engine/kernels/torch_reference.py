"""The ``torch`` provider of every op: the op's own reference (``Op.reference``), the ground truth.

Why here and not in the ops: an op defines semantics and knows nothing of providers, so
``engine.ops`` never imports ``engine.kernels``; the kernel layer turns each op's reference
into a provider that runs on every device, with a backward, traceable by ``torch.compile``.
"""

from __future__ import annotations

from engine.kernels.registry import ALL_DEVICES, KernelProvider, register
from engine.ops.base import all_ops

__all__ = ["register_references"]


def register_references() -> None:
    """Register ``torch`` for every op of :func:`engine.ops.all_ops` (once per op)."""
    for name, op in all_ops().items():
        register(
            KernelProvider(
                name="torch",
                op=name,
                devices=ALL_DEVICES,
                build=op.reference,
                description=op.reference_description,
                dtensor=True,  # plain torch ops dispatch on DTensor
            )
        )


register_references()
