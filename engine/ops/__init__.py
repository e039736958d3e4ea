"""The ops: one module per op; each defines its semantics and its torch reference (``Op.reference``)."""

from engine.ops import (  # noqa: F401  (import registers)
    fused_linear_cross_entropy,
    gated_rms_norm,
    geglu,
    layer_norm,
    linear_attention,
    mlp,
    moe_experts,
    rms_norm,
    rope,
    swiglu,
)
from engine.ops.base import FunctionOp, ModuleOp, Op, all_ops, get_op

__all__ = ["FunctionOp", "ModuleOp", "Op", "all_ops", "get_op"]
