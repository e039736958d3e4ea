"""Grouped-matmul providers of ``moe_experts``: ``grouped_mm`` (torch), ``npu`` (torch_npu), ``liger`` (CUDA).

All three replace the eager per-expert loop (one small matmul pair per expert, and in the
backward one full-size zero gradient per expert's weight slice) with one grouped matmul per
projection over the routes sorted by expert:

1. routes (token, slot) are sorted by expert (stable), tokens gathered into that order;
2. ``gate_up`` and ``down`` each run as one grouped matmul over the sorted rows
   (``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm``; ``npu_grouped_matmul``);
3. each row is scaled by its routing weight and the rows are summed back per token.

``grouped_mm`` feeds each expert the same rows in the same order as the eager loop and sums
a token's contributions as the loop's ``index_add_`` calls do (experts in ascending order,
rounded to the input dtype after each expert; duplicate routes to one expert summed in fp32
first), so its forward equals the eager forward up to the grouped matmul's own rounding
(bit-equal at the benchmark's shapes in bf16; a row 1 ulp apart in some small fp32 cases).
Its gradients come from autograd over the same graph: an expert that receives no token gets
an exact zero gradient, and a token routed twice to the same expert gets both contributions
(tests/test_moe_experts.py checks both, against the eager module).

The expert-parallel sentinel (index == number of experts) sorts after every real expert,
outside every group; its rows are masked to zero before the matmul and after it, so they
contribute nothing and receive no gradient (transformers' grouped path does the same).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.kernels.liger import LIGER
from engine.kernels.npu import TORCH_NPU
from engine.kernels.registry import KernelProvider, register
from engine.ops.moe_experts import apply_gate
from engine.schema import Device, ExpertsActivation, ExpertsLayout

__all__ = ["build_grouped_kernel", "grouped_experts", "torch_grouped_mm"]

#: ``gmm(x [S, in], weight [E, in, out], counts [E]) -> [S, out]``: one matmul per group of rows.
GroupedMatmul = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _grouped_mm_function() -> Callable[..., torch.Tensor] | None:
    return getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def _loop_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per-group ``mm`` for devices or dtypes torch's grouped kernel lacks (CUDA before sm80)."""
    outs, start = [], 0
    for e, n in enumerate(counts.tolist()):
        if n:
            outs.append(x[start:start + n] @ weight[e])
        start += n
    rest = x.shape[0] - start  # sentinel rows: outside every group
    if rest or not outs:
        outs.append(x.new_zeros(rest, weight.shape[-1]))
    return torch.cat(outs)


def _has_grouped_kernel(x: torch.Tensor) -> bool:
    if _grouped_mm_function() is None:
        return False
    if x.device.type == "cuda":
        return torch.cuda.get_device_capability(x.device) >= (8, 0)
    return x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)


def _eager_grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    if not _has_grouped_kernel(x):
        return _loop_mm(x, weight, counts)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    return _grouped_mm_function()(x, weight, offs=offsets)  # type: ignore[misc]


def torch_grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """torch's grouped matmul (CPU; CUDA sm80+), else a per-group loop. Differentiable.

    Under ``torch.compile`` in any dtype but bf16 it is one opaque op (:func:`_opaque_grouped_mm`)
    running the same eager kernel. Why: ``grouped_mm``'s meta function, which tracing runs,
    accepts bf16 only (``Expected inputs of BF16 type``), though its CPU kernel runs fp32; the
    loop's ``counts.tolist()`` would break the graph. So a compiled model computes what the
    eager one does, in every dtype.
    """
    if torch.compiler.is_compiling() and (x.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16):
        return torch.ops.patch_engine.grouped_mm(x, weight, counts)
    return _eager_grouped_mm(x, weight, counts)


# ---------------------------------------------------------------- grouped matmul as an opaque op (compile)


@torch.library.custom_op("patch_engine::grouped_mm", mutates_args=())
def _opaque_grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``y[rows of group e] = x[rows of group e] @ weight[e]``: [S, in] x [E, in, out] -> [S, out]."""
    return _eager_grouped_mm(x, weight, counts)


@torch.library.custom_op("patch_engine::grouped_mm_weight_grad", mutates_args=())
def _opaque_weight_grad(x: torch.Tensor, grad: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``out[e] = x[rows of e]^T @ grad[rows of e]``: [S, in], [S, out] -> [E, in, out] (the weight's gradient)."""
    if _has_grouped_kernel(x):
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        return _grouped_mm_function()(x.t(), grad, offs=offsets)  # type: ignore[misc]
    out, start = x.new_zeros(counts.numel(), x.shape[1], grad.shape[1]), 0
    for e, n in enumerate(counts.tolist()):
        out[e] = x[start:start + n].t() @ grad[start:start + n]
        start += n
    return out


@_opaque_grouped_mm.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[-1])


@_opaque_weight_grad.register_fake
def _(x: torch.Tensor, grad: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return x.new_empty(counts.shape[0], x.shape[1], grad.shape[1])


def _save_inputs(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs)


def _grouped_mm_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    # The formulas of torch's own derivative of grouped_mm (bit-equal to it on CPU), as these
    # two ops, so that double backward works too.
    x, weight, counts = ctx.saved_tensors
    grad = grad.contiguous()
    return (_opaque_grouped_mm(grad, weight.transpose(1, 2), counts), _opaque_weight_grad(x, grad, counts), None)


def _weight_grad_backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
    x, out_grad, counts = ctx.saved_tensors
    grad = grad.contiguous()
    return (_opaque_grouped_mm(out_grad, grad.transpose(1, 2), counts), _opaque_grouped_mm(x, grad, counts), None)


_opaque_grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_save_inputs)
_opaque_weight_grad.register_autograd(_weight_grad_backward, setup_context=_save_inputs)


def _as_in_out(weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """Expert weights as [E, in, out] (a view; transformers' non-transposed layout is [E, out, in])."""
    return weight if transposed else weight.transpose(1, 2)


def grouped_experts(
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    alpha: float | None = None,
    limit: float | None = None,
    *,
    layout: ExpertsLayout,
    transposed: bool,
    activation: ExpertsActivation,
    gmm: GroupedMatmul = torch_grouped_mm,
) -> torch.Tensor:
    """The experts over routes sorted by expert, summed per token in the eager loop's order."""
    tokens, top_k = top_k_index.shape
    num_experts = gate_up.shape[0]
    # Routes numbered slot-major (r = slot * tokens + token): sorted stably by expert, an
    # expert's rows come in the order the eager loop's torch.where gives them, so each
    # expert's matmuls (and its weight gradient's reduction over rows) see the same rows in
    # the same order.
    flat = top_k_index.t().reshape(-1)
    sorted_experts, order = torch.sort(flat, stable=True)
    # Routes per expert, in a tensor of static size: bincount's size depends on the data (an unbacked
    # symbol under torch.compile, which torch 2.14's inductor failed to bind in the backward graph)
    counts = flat.new_zeros(num_experts + 1).index_add_(0, flat, torch.ones_like(flat))[:num_experts]
    valid = (sorted_experts < num_experts).unsqueeze(-1)
    rows = hidden_states[order % tokens]
    rows = torch.where(valid, rows, 0)
    safe_experts = sorted_experts.clamp(max=num_experts - 1)

    gate_up_out = gmm(rows, _as_in_out(gate_up, transposed), counts)
    if gate_up_bias is not None:
        gate_up_out = gate_up_out + gate_up_bias[safe_experts]
    h = apply_gate(gate_up_out, layout, activation, alpha, limit)
    out = gmm(h, _as_in_out(down, transposed), counts)
    if down_bias is not None:
        out = out + down_bias[safe_experts]
    out = torch.where(valid, out, 0)
    out = (out * top_k_weights.t().reshape(-1)[order].unsqueeze(-1)).to(hidden_states.dtype)

    # Route (token, slot) sits at row position[slot, token]; a token's slots in ascending
    # expert order (ties: ascending slot) are the order the eager loop adds them in.
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)
    slot_experts, slot_order = torch.sort(top_k_index, dim=1, stable=True)
    picks = position.view(top_k, tokens).t().gather(1, slot_order)
    contributions = out[picks.reshape(-1)].view(tokens, top_k, -1)
    return _sum_like_index_add(contributions, slot_experts)


def _sum_like_index_add(contributions: torch.Tensor, slot_experts: torch.Tensor) -> torch.Tensor:
    """Sum [T, K, H] over K in the eager loop's rounding: one ``index_add_`` per expert.

    ``index_add_`` adds in fp32 and rounds once per call, so a token's routes to one expert
    (duplicates) are summed in fp32 before the one rounding; routes to different experts
    round after each. In fp32 this is the plain sequential sum.
    """
    dtype = contributions.dtype
    slots = contributions.unbind(1)  # one backward allocation, not one zero [T, K, H] per slot
    if dtype == torch.float32 or len(slots) == 1:
        result = slots[0]
        for contribution in slots[1:]:
            result = result + contribution
        return result
    acc = slots[0].float()
    for slot in range(1, len(slots)):
        same = (slot_experts[:, slot] == slot_experts[:, slot - 1]).unsqueeze(-1)
        acc = torch.where(same, acc, acc.to(dtype).float()) + slots[slot].float()
    return acc.to(dtype)


def _settings(patch: Any) -> dict[str, Any]:
    return {"layout": patch.layout, "transposed": patch.transposed, "activation": patch.activation}


def build_grouped_kernel(patch: Any) -> Callable[..., torch.Tensor]:
    """The ``grouped_mm`` provider's kernel for ``patch``'s declared layout (also what ``compiled`` compiles)."""
    settings = _settings(patch)

    def experts(*args: Any, **kwargs: Any) -> torch.Tensor:
        return grouped_experts(*args, **kwargs, **settings)

    return experts


# ---------------------------------------------------------------- npu


def _build_npu(patch: Any) -> Callable[..., torch.Tensor]:
    """``npu_moe_token_permute`` -> ``npu_grouped_matmul`` x2 -> ``npu_moe_token_unpermute`` (weights applied there)."""
    import torch_npu as npu

    settings = _settings(patch)

    def gmm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return npu.npu_grouped_matmul([x], [weight], group_list=counts, split_item=2, group_type=0,
                                      group_list_type=1)[0]

    def experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
                down_bias: torch.Tensor | None = None, alpha: float | None = None,
                limit: float | None = None) -> torch.Tensor:
        num_experts = gate_up.shape[0]
        index = top_k_index.to(torch.int32)
        permuted, sorted_indices = npu.npu_moe_token_permute(hidden_states, index)
        counts = torch.bincount(top_k_index.reshape(-1), minlength=num_experts)[:num_experts].to(torch.int64)
        row_experts = torch.sort(top_k_index.reshape(-1), stable=True).values if (gate_up_bias is not None
                                                                               or down_bias is not None) else None
        gate_up_out = gmm(permuted, _as_in_out(gate_up, settings["transposed"]), counts)
        if gate_up_bias is not None:
            gate_up_out = gate_up_out + gate_up_bias[row_experts]
        h = apply_gate(gate_up_out, settings["layout"], settings["activation"], alpha, limit)
        out = gmm(h, _as_in_out(down, settings["transposed"]), counts)
        if down_bias is not None:
            out = out + down_bias[row_experts]
        probs = top_k_weights.to(out.dtype)
        return npu.npu_moe_token_unpermute(out, sorted_indices, probs=probs).to(hidden_states.dtype)

    return experts


# ---------------------------------------------------------------- liger


def _build_liger(patch: Any) -> Callable[..., torch.Tensor]:
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    def experts(hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: Any = None, down_bias: Any = None,
                alpha: Any = None, limit: Any = None) -> torch.Tensor:
        return LigerFusedMoEFunction.apply(hidden_states, gate_up, down, top_k_index.to(torch.int32), top_k_weights)

    return experts


def _liger_supports(patch: Any) -> str | None:
    if patch.transposed or patch.layout is not ExpertsLayout.concatenated:
        return "liger's fused MoE takes [E, 2I, H] weights with concatenated [gate | up] only"
    if patch.activation is not ExpertsActivation.silu or patch.gate_up_bias or patch.down_bias:
        return "liger's fused MoE computes silu(gate) * up without biases"
    return None


register(KernelProvider(
    name="grouped_mm", op="moe_experts", devices=frozenset({Device.cpu, Device.cuda}), build=build_grouped_kernel,
    description="routes sorted by expert, torch grouped_mm (CPU; CUDA sm80+, else a per-expert loop)"))
register(KernelProvider(
    name="npu", op="moe_experts", devices=frozenset({Device.npu}), build=_build_npu, requires=(TORCH_NPU,),
    description="torch_npu.npu_moe_token_permute + npu_grouped_matmul + npu_moe_token_unpermute"))
register(KernelProvider(
    name="liger", op="moe_experts", devices=frozenset({Device.cuda}), build=_build_liger, requires=(LIGER,),
    supports=_liger_supports, compile_safe=False, description="liger_kernel LigerFusedMoEFunction (Triton)"))
