"""The ops: one module per op, each with its torch reference registered as the ``torch`` kernel."""

from engine.ops import fused_linear_cross_entropy, rms_norm, rope, swiglu  # noqa: F401  (import registers)
from engine.ops.base import FunctionOp, ModuleOp, Op, all_ops, get_op

__all__ = ["Op", "ModuleOp", "FunctionOp", "get_op", "all_ops"]
