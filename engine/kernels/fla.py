"""flash-linear-attention (Triton) kernels for CUDA and NPU, imported only inside ``build``.

* ``linear_attention``: per rule (:data:`FLA_KERNELS`), fla's chunk kernel for ``form: chunk``
  (training, prefill) and its fused recurrent kernel for ``form: recurrent`` (decode):
  ``chunk_gated_delta_rule`` / ``fused_recurrent_gated_delta_rule``, ``chunk_kda`` /
  ``fused_recurrent_kda``. fla's recurrent kernels have no backward (it raises ``NotImplementedError``), so a
  recurrent call that needs a gradient runs fla's chunk kernel, which computes the same
  recurrence and has one. Arguments are passed by name; ``chunk_size`` is transformers'
  torch-path tiling and is not fla's to take (fla tiles by 64 itself). ``scale`` is left to
  fla's default ``Dk ** -0.5``, the torch path's scaling.
* ``gated_rms_norm``: fla's ``rms_norm_gated`` computes ``x_hat * w * act(gate)`` all in fp32
  and rounds once. That is transformers' fp32 cast order (kimi_linear's sigmoid gate,
  lara_mini's silu gate), so fla is offered for ``cast: fp32`` or ``precision: fp32`` with the
  gate after the norm and no groups. It is *not* the Qwen3-Next / Qwen3.5 order (G_QNEXT:
  ``w * x_hat.to(bf16)``, rounded before the weight multiply), which differs in bf16:
  there ``kernel: auto`` passes fla over. (transformers' own source notes that "the FLA
  package does not re-cast to input_dtype".)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

from engine.kernels.registry import Dependency, KernelProvider, register
from engine.schema import CastOrder, DeltaRule, DeltaRuleForm, Device, Precision, Scale

__all__ = ["FLA", "FLA_DEVICES"]

FLA = Dependency("fla", "flash-linear-attention", "fla")
FLA_DEVICES = frozenset({Device.cuda, Device.npu})


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


#: fla's (module, chunk kernel, recurrent kernel) per rule.
FLA_KERNELS: dict[DeltaRule, tuple[str, str, str]] = {
    DeltaRule.gated_delta_rule: ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule",
                                 "fused_recurrent_gated_delta_rule"),
    DeltaRule.kimi_delta_attention: ("fla.ops.kda", "chunk_kda", "fused_recurrent_kda"),
}


def _build_linear_attention(patch: Any) -> Callable[..., Any]:
    module_name, chunk_name, recurrent_name = FLA_KERNELS[patch.rule]
    module = importlib.import_module(module_name)
    chunk_kernel, recurrent_kernel = getattr(module, chunk_name), getattr(module, recurrent_name)

    def chunk(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              chunk_size: int = 64, initial_state: torch.Tensor | None = None, output_final_state: bool = False,
              use_qk_l2norm_in_kernel: bool = False, cu_seqlens: torch.Tensor | None = None,
              **_: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        return chunk_kernel(
            query, key, value, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
        )

    def recurrent(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                  use_qk_l2norm_in_kernel: bool = False, cu_seqlens: torch.Tensor | None = None,
                  **_: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        if _needs_grad(query, key, value, g, beta, initial_state):
            return chunk(query, key, value, g, beta, initial_state=initial_state,
                         output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                         cu_seqlens=cu_seqlens)
        return recurrent_kernel(
            query, key, value, g=g, beta=beta, initial_state=initial_state, output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
        )

    return chunk if patch.form is DeltaRuleForm.chunk else recurrent


def _build_gated_rms_norm(patch: Any) -> Callable[..., torch.Tensor]:
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    activation = "sigmoid" if patch.activation.value == "sigmoid" else "swish"
    one_plus = patch.scale is Scale.one_plus_weight

    def gated(x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, eps: float,
              group_size: int | None = None) -> torch.Tensor:
        w = weight.float() + 1.0 if one_plus else weight
        if gate is None:  # only reachable when the patch allows it: no gating, same fp32 order
            from engine.ops.rms_norm import rms_norm_reference

            return rms_norm_reference(x, weight, eps, scale=patch.scale, cast=CastOrder.fp32)
        return rms_norm_gated(x, gate, w, None, activation=activation, eps=eps)

    return gated


def _gated_supports(patch: Any) -> str | None:
    if patch.order.value != "norm_then_gate":
        return "fla's gated norm applies the gate after the norm"
    if any(getattr(patch, k, None) is not None for k in ("group_size", "group_size_attr", "num_groups_attr")):
        return "fla's rms_norm_gated normalizes the whole last dimension"
    if patch.cast is CastOrder.llama and patch.precision is Precision.native:
        return "fla rounds once in fp32; the declared llama cast order rounds x_hat before the weight multiply"
    return None


register(KernelProvider(
    name="fla", op="linear_attention", devices=FLA_DEVICES, build=_build_linear_attention, requires=(FLA,),
    has_backward=True, compile_safe=False,
    description="fla chunk / fused_recurrent kernels (gated delta rule, kda)",
))
register(KernelProvider(
    name="fla", op="gated_rms_norm", devices=FLA_DEVICES, build=_build_gated_rms_norm, requires=(FLA,),
    has_backward=True, compile_safe=False, supports=_gated_supports,
    description="fla rms_norm_gated (fp32 cast order only)",
))
