"""``liger`` provider of ``fused_linear_cross_entropy``: Liger-Kernel's Triton FLCE (CUDA and Ascend NPU).

On CUDA it is ``liger_kernel.ops.fused_linear_cross_entropy``; on an Ascend NPU, liger-kernel
0.8.5's Ascend backend, ``liger_kernel.ops.backends._ascend.ops.fused_linear_cross_entropy``
(the class liger itself substitutes on NPU: one Cube GEMM per chunk, the same positional
contract minus ``chunk_mem_const``). The class is chosen by the tensors' device at call time.

Kept in its own file (not a general ``liger.py``) so the norm/MLP liger providers can live
elsewhere without a merge; the lead may fold it into one liger backend file.

The argument mapping is the risk here: ``LigerFusedLinearCrossEntropyFunction.apply`` takes
only positional arguments, and its parameter list has grown between releases (0.8.5 has 18).
So the call is built by binding keyword arguments to the installed ``forward``'s own signature
(:func:`liger_arguments`), never by position. ``num_items_in_batch`` maps to
``reduction="sum"`` followed by a division, exactly as transformers' ``fixed_cross_entropy``
and Liger's own ``LigerForCausalLMLoss`` do; the head-gradient accumulation runs in fp32
in the weight's dtype (``accum_dtype=None``, Liger's default, as the torch kernel does: no fp32
``[V, H]`` buffer in bf16). Gemma's soft-cap maps to ``softcap``. Granite's logit division (``logits / config.logits_scaling``)
has no parameter in Liger's FLCE (Liger's own ``apply_liger_kernel_to_granite`` refuses its fused
loss), so :func:`_supports` refuses it at plan time and ``auto`` passes over liger to the torch
kernel; dividing the weight or the hidden states first would round differently. Not run here (no GPU): tests/test_flce.py checks the mapping against the
installed signature when liger-kernel imports, and against a torch emulator of the documented
contract otherwise.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from engine.kernels.registry import Dependency, KernelProvider, register
from engine.schema import Device

__all__ = ["LIGER", "liger_arguments", "liger_flce", "liger_function_for"]

LIGER = Dependency(module="liger_kernel", package="liger-kernel", extra="cuda")


def liger_arguments(forward: Callable[..., Any], **kwargs: Any) -> tuple[Any, ...]:
    """Positional arguments for ``Function.apply`` from keyword arguments, by ``forward``'s signature.

    Raises:
        TypeError: a keyword the installed version does not take (named by ``inspect``).
    """
    params = list(inspect.signature(forward).parameters.values())[1:]  # drop ctx
    bound = inspect.Signature(params).bind(**kwargs)
    bound.apply_defaults()
    return tuple(bound.arguments[p.name] for p in params)


def liger_flce(function: Any) -> Callable[..., torch.Tensor]:
    """The kernel for a Liger ``LigerFusedLinearCrossEntropyFunction``-like ``function``.

    ``function`` is the autograd Function, or ``device_type -> Function`` (chosen per call).
    """

    def kernel(
        hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, *,
        ignore_index: int = -100, num_items_in_batch: Any = None, chunk_size: int | None = None,
        softcap: float | None = None, logit_divisor: float | None = None,
    ) -> torch.Tensor:
        if logit_divisor is not None:  # refused at plan time (_supports); never computed without it
            raise ValueError("liger's fused linear cross-entropy has no logit division (Granite's logits_scaling)")
        fn = function(hidden.device.type) if callable(function) and not hasattr(function, "apply") else function
        reduction = "sum" if num_items_in_batch is not None else "mean"
        args = liger_arguments(
            fn.forward, _input=hidden, weight=weight, target=target, ignore_index=ignore_index,
            reduction=reduction, softcap=softcap,
        )
        out = fn.apply(*args)
        loss = out[0] if isinstance(out, tuple) else out
        if num_items_in_batch is None:
            return loss
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        return loss / num_items_in_batch

    return kernel


def liger_function_for(device_type: str) -> Any:
    """Liger's FLCE autograd Function for a device type: the Ascend backend's on ``npu``, else CUDA's."""
    if device_type == "npu":
        from liger_kernel.ops.backends._ascend.ops.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyFunction as AscendFunction,
        )

        return AscendFunction
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    return LigerFusedLinearCrossEntropyFunction


def _supports(settings: Any) -> str | None:
    """Refuse what Liger's FLCE does not compute: a logit division read from the forward (Granite)."""
    contract = getattr(settings, "contract", None)
    if getattr(contract, "divisor_path", None) is not None:
        return (f"liger: no logit division (the forward divides its logits by self.{'.'.join(contract.divisor_path)}, "
                "as Granite does); use kernel torch")
    return None


def _build(patch: Any) -> Callable[..., torch.Tensor]:
    return liger_flce(liger_function_for)


register(
    KernelProvider(
        name="liger",
        op="fused_linear_cross_entropy",
        devices=frozenset({Device.cuda, Device.npu}),
        build=_build,
        supports=_supports,
        requires=(LIGER,),
        description="Liger-Kernel Triton fused linear cross-entropy, CUDA and its Ascend backend (chunks by Liger)",
    )
)
