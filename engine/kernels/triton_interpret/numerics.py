"""Shims ``bf16``, ``tf32`` and ``bf16_atomic``: the interpreter's arithmetic rounds as a GPU's does.

Why: numpy has no bfloat16, so the interpreter stores it as uint16 and runs numpy on the bit
patterns, and it multiplies fp32 dots in full precision where NVIDIA's default is TF32. A kernel
judged interpreted must round as it will on the GPU, neither worse (bit patterns) nor better
(full fp32 dots), or the verdict says nothing about the hardware.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from engine.kernels.triton_interpret._state import Shim, set_attr

__all__ = ["SHIMS", "install"]

SHIMS: tuple[Shim, ...] = (
    Shim("bf16",
         "the interpreter stores bfloat16 as uint16 (numpy has no bf16): (1) its binary, unary, ternary, fma and dot "
         "ops run numpy on that storage, so bf16 * bf16 multiplies bit patterns as integers (liger's SiLU-mul "
         "`silu(a).cast(b.dtype) * b`: NaN / inf where a GPU computes numbers); (2) its fp32 -> bf16 cast "
         "(`_convert_float`) truncates by default and its 'rtne' rounds half up without carrying into the "
         "exponent, where a GPU's `.to(tl.bfloat16)` rounds to nearest even",
         "arithmetic (and tl.dot) on bf16 operands widens them to fp32 and rounds a bf16 result once; fp32/fp64 -> bf16 "
         "casts round to nearest even (torch's conversion), an explicit 'rtz' still truncates",
         "`InterpreterBuilder.binary_op` multiplies two bf16 handles' values, and `cast_impl` of "
         "fp32 1.00390625 + 2**-9 to bf16 gives 1.0078125"),
    Shim("tf32",
         "tl.dot on fp32 operands defaults to input_precision 'tf32' (NVIDIA tensor cores keep 10 mantissa bits "
         "of each operand), but the interpreter's `create_dot` ignores input_precision and multiplies in full "
         "fp32: an fp32 kernel would look more exact interpreted than on the GPU (fla's chunk kernels)",
         "for input_precision tf32, fp32 operands are rounded to tf32 (10 mantissa bits, to nearest, ties away "
         "from zero as PTX `cvt.rna.tf32.f32`) before the product; 'ieee' and 'tf32x3' stay full fp32",
         "`InterpreterBuilder.create_dot` reads input_precision"),
    Shim("bf16_atomic",
         "`tl.atomic_add` into bf16 memory (liger's fused MoE backward, `_moe_bwd_down_proj_kernel`, "
         "accumulates dS across N-tiles) raises ValueError: Unsupported data type: the interpreter's "
         "`create_atomic_rmw` hands the uint16 storage to its C++ `atomic_rmw`, which knows no bf16",
         "an fadd (or xchg) on bf16 reads the old values, adds in fp32 and rounds the sum to nearest even (as "
         "sm_90's `atom.add.noftz.bf16`, and the compare-and-swap loop triton emits before it), writes it back "
         "and returns the old values, lane by lane where lanes share an address; the interpreter runs one "
         "program at a time, so nothing interleaves",
         "`InterpreterBuilder.create_atomic_rmw` with a bf16 value and ATOMIC_OP.FADD returns without raising"),
)


def by_name(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` called with its arguments by name; a parameter not given gets ``None`` (a cache hint).

    Why: the builder's memory methods differ between the triton releases the allowed torches pin
    (3.8: ``create_masked_load(ptrs, mask, other, cache_modifier, eviction_policy, is_volatile)``;
    3.9: ``(ptrs, mask, other, cache_policy, is_volatile)``), in hints the interpreter ignores.
    Read from the signature, not from a version string: a release that renames a hint again still binds.
    """
    names = [n for n in inspect.signature(method).parameters if n != "self"]

    def call(self: Any, **given: Any) -> Any:
        unknown = set(given) - set(names)
        if unknown:  # a parameter we rely on is gone: say so rather than call with it dropped
            raise TypeError(f"{method.__qualname__}{inspect.signature(method)} takes no {sorted(unknown)}")
        return method(self, *(given.get(n) for n in names))

    return call


def install() -> None:
    """bf16 arithmetic in fp32 rounded once, TF32 fp32 dots, bf16 atomics."""
    import numpy as np
    import torch
    import triton.language as tl
    from triton._C.libtriton import ir as _ir
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def to_bf16(h: Any) -> Any:  # round to nearest even, NaN kept NaN
        data = np.ascontiguousarray(h.data)
        bits = torch.from_numpy(data).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        return TensorHandle(bits.reshape(data.shape), tl.bfloat16)

    cast_impl, fp_to_fp = InterpreterBuilder.cast_impl, InterpreterBuilder.create_fp_to_fp

    def cast(self: Any, src: Any, dst_type: Any) -> Any:
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar in (tl.float32, tl.float64):
            return to_bf16(src)
        return cast_impl(self, src, dst_type)

    def create_fp_to_fp(self: Any, src: Any, dst_type: Any, rounding_mode: Any) -> Any:
        if (dst_type.scalar == tl.bfloat16 and src.dtype.scalar in (tl.float32, tl.float64)
                and rounding_mode != _ir.ROUNDING_MODE.RTZ):
            return to_bf16(src)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    set_attr(InterpreterBuilder, "cast_impl", cast)
    set_attr(InterpreterBuilder, "create_fp_to_fp", create_fp_to_fp)

    def wide(builder: Any, h: Any) -> Any:
        return builder.cast_impl(h, tl.float32) if h.dtype.scalar == tl.bfloat16 else h

    def narrow(builder: Any, h: Any, was_bf16: bool) -> Any:
        return builder.cast_impl(h, tl.bfloat16) if was_bf16 and h.dtype.scalar == tl.float32 else h

    binary, unary, ternary, fma = (InterpreterBuilder.binary_op, InterpreterBuilder.unary_op,
                                   InterpreterBuilder.ternary_op, InterpreterBuilder.create_fma)
    dot, rmw = InterpreterBuilder.create_dot, InterpreterBuilder.create_atomic_rmw
    load, store = by_name(InterpreterBuilder.create_masked_load), by_name(InterpreterBuilder.create_masked_store)

    def tf32(h: Any) -> Any:
        bits = np.ascontiguousarray(h.data, dtype=np.float32).view(np.uint32)
        rounded = ((bits + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)  # to nearest, ties away
        return TensorHandle(np.where(np.isfinite(h.data), rounded, h.data).astype(np.float32), tl.float32)

    def create_dot(self: Any, a: Any, b: Any, d: Any, input_precision: Any, max_num_imprecise_acc: Any) -> Any:
        if (input_precision == _ir.INPUT_PRECISION.TF32 and a.dtype.scalar == tl.float32
                and b.dtype.scalar == tl.float32):
            return dot(self, tf32(a), tf32(b), d, input_precision, max_num_imprecise_acc)
        if tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar, d.dtype.scalar):
            return dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        out = dot(self, wide(self, a), wide(self, b), wide(self, d), input_precision, max_num_imprecise_acc)
        return narrow(self, out, d.dtype.scalar == tl.bfloat16)  # bf16 x bf16 accumulates in fp32 (an fp32 d)

    def binary_op(self: Any, lhs: Any, rhs: Any, op: Any) -> Any:
        bf16 = tl.bfloat16 in (lhs.dtype.scalar, rhs.dtype.scalar)
        if not bf16 or op in (np.bitwise_and, np.bitwise_or, np.bitwise_xor):
            return binary(self, lhs, rhs, op)
        return narrow(self, binary(self, wide(self, lhs), wide(self, rhs), op), True)

    def unary_op(self: Any, arg: Any, op: Any) -> Any:
        if arg.dtype.scalar != tl.bfloat16:
            return unary(self, arg, op)
        return narrow(self, unary(self, wide(self, arg), op), True)

    def ternary_op(self: Any, a: Any, b: Any, c: Any, op: Any) -> Any:
        if op is np.where or tl.bfloat16 not in (a.dtype.scalar, b.dtype.scalar, c.dtype.scalar):
            return ternary(self, a, b, c, op)  # a select moves bit patterns: right as it is
        return narrow(self, ternary(self, wide(self, a), wide(self, b), wide(self, c), op), True)

    def create_fma(self: Any, x: Any, y: Any, z: Any) -> Any:
        if tl.bfloat16 not in (x.dtype.scalar, y.dtype.scalar, z.dtype.scalar):
            return fma(self, x, y, z)
        return narrow(self, fma(self, wide(self, x), wide(self, y), wide(self, z)), True)

    def create_atomic_rmw(self: Any, rmw_op: Any, ptr: Any, val: Any, mask: Any, sem: Any, scope: Any) -> Any:
        if val.dtype.scalar != tl.bfloat16 or rmw_op not in (_ir.ATOMIC_OP.FADD, _ir.ATOMIC_OP.XCHG):
            return rmw(self, rmw_op, ptr, val, mask, sem, scope)
        ptrs, vals, lanes = np.broadcast_arrays(ptr.data, val.data, mask.data)
        shape = ptrs.shape
        ptrs, vals, lanes = ptrs.reshape(-1), vals.reshape(-1), lanes.reshape(-1).astype(bool)
        old = np.zeros(ptrs.shape, dtype=np.uint16)
        active = np.flatnonzero(lanes)
        # lanes sharing an address take turns, in lane order; otherwise all at once
        groups = [active] if len(np.unique(ptrs[active])) == len(active) else [active[i:i + 1] for i in
                                                                                 range(len(active))]
        for idx in groups:
            at = TensorHandle(ptrs[idx], ptr.dtype)
            on = TensorHandle(np.ones(len(idx), dtype=bool), tl.int1)
            current = load(self, ptrs=at, mask=on, other=None, is_volatile=True)
            old[idx] = current.data
            value = TensorHandle(vals[idx], tl.bfloat16)
            new = binary_op(self, current, value, np.add) if rmw_op == _ir.ATOMIC_OP.FADD else value
            store(self, ptrs=at, value=new, mask=on)
        return TensorHandle(old.reshape(shape), tl.bfloat16)

    set_attr(InterpreterBuilder, "binary_op", binary_op)
    set_attr(InterpreterBuilder, "unary_op", unary_op)
    set_attr(InterpreterBuilder, "ternary_op", ternary_op)
    set_attr(InterpreterBuilder, "create_fma", create_fma)
    set_attr(InterpreterBuilder, "create_dot", create_dot)
    set_attr(InterpreterBuilder, "create_atomic_rmw", create_atomic_rmw)
