"""The torch kernels of ``fused_linear_cross_entropy``: the reference and the chunked one.

Kernel signature (every provider): ``kernel(hidden [N, H], weight [V, H], target [N], *,
ignore_index, num_items_in_batch, chunk_size, softcap, logit_divisor) -> loss`` (a 0-d fp32
tensor), where ``target`` is already shifted. It computes what transformers computes after the
backbone: ``logits = hidden @ weight.T`` in the model's dtype, ``logits / logit_divisor`` when
the family scales its logits (Granite's ``logits_scaling``: each chunk's logits are divided,
exactly as the model divides them, never the hidden states or the weight), ``softcap * tanh(logits / softcap)``
when the family soft-caps (Gemma 2/3), ``logits.float()``, then ``cross_entropy`` with
``reduction="mean"``, or ``"sum"`` divided by ``num_items_in_batch`` when that is given.

The chunked kernel computes the loss chunk by chunk over tokens. Because the loss is the
last node of the graph, each chunk's gradients with respect to its hidden states and to the
head weight are computed in the forward (Liger-Kernel's trick), so nothing of size
``[tokens, vocab]`` outlives one chunk. Memory, per the measurements of issue 13:

* one chunk's buffers at a time: the previous chunk's logits and gradient are released
  before the next chunk's logits are allocated;
* the log-sum-exp is formed in place (max, subtract, exp, sum) on the chunk's fp32 logits,
  which then become the softmax and the logits' gradient, in place again;
* the head-weight gradient accumulates *in place* (``addmm_``) in the weight's own dtype: in
  fp32 an fp32 buffer, in bf16 a bf16 buffer (each chunk's product is accumulated in fp32
  inside the matmul and rounded once when added; this is what Liger does without
  ``accum_dtype``), so no fp32 ``[V, H]`` buffer or temporary exists in bf16;
* backward scales the stored gradients in place when ``grad_output != 1`` (gradient
  accumulation, loss scaling), so autograd still adopts the buffers as ``.grad``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "CHUNK_BUDGET_BYTES",
    "CHUNK_MIN_BYTES",
    "auto_chunk_size",
    "chunked_linear_cross_entropy",
    "linear_cross_entropy_reference",
]

#: The chunk size, when not given, is an eighth of the tokens, between these bounds on one
#: chunk's fp32 logits (see :func:`auto_chunk_size`).
CHUNK_MIN_BYTES = 32 << 20
CHUNK_BUDGET_BYTES = 256 << 20
CHUNKS = 8


def auto_chunk_size(num_tokens: int, vocab: int) -> int:
    """Tokens per chunk: ``num_tokens / 8``, with one chunk's fp32 logits between 32 and 256 MiB.

    Why an eighth: the head-gradient accumulator (``[V, H]``) is read and written once per
    chunk, and a CPU matmul with few rows runs at a fraction of its speed (at hidden 1024 and
    vocab 151,936: about 115 GFLOP/s up to 256 rows, 145 from 384, 163 at 1024 on 2 cores),
    so a fixed number of chunks keeps that overhead a fixed share of the time, while the
    chunk's logits stay an eighth of what the unfused head materializes. The bounds keep a
    short batch from running a matmul of a few rows (32 MiB: 55 tokens at vocab 151,936) and a
    long one from spending more than 256 MiB (441 tokens) on one chunk. Measured in
    ``benchmarks/flce.py``: a training step of 1,024 tokens stays within 10% of its memory
    floor (128-token chunks), and 4,096 tokens (441-token chunks) run near the peer's speed.
    """
    row_bytes = 4 * vocab
    lo, hi = max(1, CHUNK_MIN_BYTES // row_bytes), max(1, CHUNK_BUDGET_BYTES // row_bytes)
    return max(1, min(num_tokens, max(lo, min(hi, -(-num_tokens // CHUNKS)))))


def _denominator(target: torch.Tensor, ignore_index: int, num_items_in_batch: Any) -> float:
    """What transformers divides the summed loss by: the valid-token count, or num_items_in_batch."""
    if num_items_in_batch is None:
        return float((target != ignore_index).sum())
    return float(num_items_in_batch)


def _capped(logits: torch.Tensor, softcap: float | None, divisor: float | None = None) -> torch.Tensor:
    """Granite's logit division, then Gemma's final-logit soft-capping, in the logits' dtype and in transformers' order."""
    if divisor is not None:
        logits = logits / divisor
    if softcap is None:
        return logits
    return torch.tanh(logits / softcap) * softcap


def linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    num_items_in_batch: Any = None,
    chunk_size: int | None = None,
    softcap: float | None = None,
    logit_divisor: float | None = None,
) -> torch.Tensor:
    """The ground truth: all logits materialized, exactly as transformers' forward + ``ForCausalLMLoss``."""
    logits = _capped(F.linear(hidden, weight), softcap, logit_divisor).float()
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = F.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
    if num_items_in_batch is None:
        return loss
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _onednn_linear() -> Any:
    """oneDNN's linear (the op inductor's CPU fusions call), where this torch build has it; else None."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


_ONEDNN_LINEAR = _onednn_linear()
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _head_logits(h: torch.Tensor, weight: torch.Tensor, buffers: _ChunkBuffers) -> torch.Tensor:
    """``F.linear(h, weight)``: the chunk's logits in the model's dtype.

    Why oneDNN for fp32 on CPU: ``F.linear`` runs an fp32 ``h @ W.T`` with a 151,936-wide
    output through MKL's sgemm at about 115 GFLOP/s on the 2-core AMD EPYC of
    benchmarks/results/cpu.md, while oneDNN's linear runs it about 1.5x faster (128 rows: 222 vs
    337 ms); the same sums in another order (max relative difference 1e-6 against MKL; bf16
    already goes through oneDNN in ``F.linear``, bit for bit). Elsewhere: ``mm`` into the
    reused buffer, which is ``F.linear`` bit for bit.
    """
    plain = type(h) in _PLAIN and type(weight) in _PLAIN  # not DTensor or another subclass
    if (_ONEDNN_LINEAR is not None and plain and h.device.type == "cpu" and h.dtype == torch.float32
            and weight.dtype == torch.float32 and h.is_contiguous() and weight.is_contiguous()):
        try:
            return _ONEDNN_LINEAR(h, weight, None, "none", [], "")
        except (RuntimeError, NotImplementedError):  # an input oneDNN refuses: the plain path below
            pass
    return torch.mm(h, weight.t(), out=buffers.get("raw", h.shape[0], h, weight.shape[0], h.dtype))


class _ChunkBuffers:
    """The chunk's logits buffers, allocated once and reused by every chunk.

    Why: a chunk's logits are tens of MiB; allocated per chunk, the allocator maps and unmaps
    them each time and the kernel zero-fills fresh pages on first touch. Chunks run one after
    another, so one buffer per role (the head's output, its fp32 copy) is enough.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, role: str, rows: int, like: torch.Tensor, cols: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get(role)
        if buf is None or buf.shape[0] < rows or buf.dtype != dtype:
            buf = self._buffers[role] = torch.empty(rows, cols, dtype=dtype, device=like.device)
        return buf[:rows]


def _chunk_loss_and_grad(
    h: torch.Tensor, weight: torch.Tensor, t: torch.Tensor, ignore_index: int, denominator: float,
    softcap: float | None, divisor: float | None, need_grad: bool, buffers: _ChunkBuffers | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk: its summed loss, and the gradient of ``loss / denominator`` w.r.t. its raw logits."""
    valid = t != ignore_index
    safe_t = torch.where(valid, t, 0).unsqueeze(1)
    buffers = buffers or _ChunkBuffers()
    vocab = weight.shape[0]
    raw = _head_logits(h, weight, buffers)  # as the model: the head in its dtype
    if divisor is not None:
        raw.div_(divisor)  # as the model divides its logits (in place)
    capped = _capped(raw, softcap)
    if capped is raw and raw.dtype != torch.float32:
        z = buffers.get("fp32", h.shape[0], h, vocab, torch.float32).copy_(raw)  # the loss in fp32
    else:
        z = capped.float()  # fp32 already (the buffer itself), or soft-capped (a fresh tensor)
    del raw
    if softcap is None:
        capped = None
    elif z is capped:
        z = capped.clone()  # fp32 with soft-capping: the capped logits are kept for the tanh derivative
    m = z.amax(dim=1, keepdim=True)
    z.sub_(m)
    target_shifted = z.gather(1, safe_t).squeeze(1)
    z.exp_()
    total = z.sum(dim=1, keepdim=True)
    token_loss = total.log().squeeze(1) - target_shifted  # lse - logit[target], without a lse temporary
    loss_sum = token_loss.masked_fill_(~valid, 0.0).sum()
    if not need_grad:
        return loss_sum, None
    # softmax / denominator for valid rows (one in-place pass), minus 1 / denominator at the target
    row_scale = valid.to(z.dtype).unsqueeze(1) / (total * denominator)
    grad = z.mul_(row_scale)
    grad.scatter_add_(1, safe_t, (-valid.to(grad.dtype) / denominator).unsqueeze(1))
    if capped is not None:  # d(softcap * tanh(x / softcap))/dx = 1 - tanh^2, tanh = capped / softcap
        tanh = capped.float() if capped.dtype != torch.float32 else capped
        del capped
        grad.mul_(tanh.div_(softcap).square_().neg_().add_(1.0))
        del tanh
    if grad.dtype != h.dtype:  # the model's logits.float() casts its gradient back: into the free head buffer
        grad = buffers.get("raw", h.shape[0], h, vocab, h.dtype).copy_(grad)
    if divisor is not None:  # d(x / divisor)/dx, in the logits' dtype as autograd's DivBackward
        grad = grad.div_(divisor)
    return loss_sum, grad


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Loss and both gradients, chunk by chunk, in the forward; backward hands them over."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor,
        ignore_index: int, denominator: float, chunk_size: int | None, softcap: float | None, divisor: float | None,
    ) -> torch.Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        # Ignored tokens (prompt, padding) add nothing to the loss or the gradients: only the
        # others go through the head, as cut-cross-entropy does (less time, same numbers).
        keep = (target != ignore_index).nonzero().squeeze(1)
        selected = keep.numel() < target.numel()
        rows, labels = (hidden.index_select(0, keep), target.index_select(0, keep)) if selected else (hidden, target)
        chunk_size = chunk_size or auto_chunk_size(target.numel(), weight.shape[0])
        grad_rows = (torch.empty_like(rows) if need_h else None)
        # In the weight's dtype, accumulated in place: no fp32 [V, H] buffer or temporary in bf16.
        grad_w = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_w else None
        buffers = _ChunkBuffers()
        for start in range(0, rows.shape[0], chunk_size):
            h = rows[start : start + chunk_size]
            chunk_loss, grad = _chunk_loss_and_grad(
                h, weight, labels[start : start + chunk_size], ignore_index, denominator, softcap, divisor,
                need_h or need_w, buffers,
            )
            loss_sum += chunk_loss
            if grad is not None:
                if grad_rows is not None:
                    torch.mm(grad, weight, out=grad_rows[start : start + chunk_size])
                if grad_w is not None and start == 0:
                    torch.mm(grad.t(), h, out=grad_w)  # the first chunk writes: no zero-filled [V, H] pass
                elif grad_w is not None:
                    grad_w.addmm_(grad.t(), h)
            del grad, chunk_loss  # released before the next chunk's logits exist
        if grad_w is not None and rows.shape[0] == 0:
            grad_w.zero_()
        grad_h = grad_rows
        if grad_rows is not None and selected:
            grad_h = torch.zeros_like(hidden).index_copy_(0, keep, grad_rows)
        del grad_rows, rows
        # Kept as attributes, not saved tensors: backward drops the last reference before returning
        # them, so autograd adopts the buffers as .grad instead of copying a [vocab, hidden] tensor.
        ctx.grads = (grad_h, grad_w)
        return loss_sum / denominator

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        grads = ctx.__dict__.pop("grads", None)
        if grads is None:
            raise RuntimeError(
                "fused_linear_cross_entropy: backward runs once per forward (the gradients are computed in the "
                "forward and handed over); run the forward again instead of retain_graph=True"
            )
        grad_h, grad_w = grads
        del grads
        if not bool(grad_output == 1):  # in place: no second [V, H] buffer, and .grad still adopts it
            if grad_h is not None:
                grad_h.mul_(grad_output.to(grad_h.dtype))
            if grad_w is not None:
                grad_w.mul_(grad_output.to(grad_w.dtype))
        return grad_h, grad_w, None, None, None, None, None, None


def chunked_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    *,
    ignore_index: int = -100,
    num_items_in_batch: Any = None,
    chunk_size: int | None = None,
    softcap: float | None = None,
    logit_divisor: float | None = None,
) -> torch.Tensor:
    """The ``torch`` provider: chunked over tokens, gradients computed per chunk, accumulated in place."""
    denominator = _denominator(target, ignore_index, num_items_in_batch)
    return _ChunkedLinearCrossEntropy.apply(
        hidden, weight, target, ignore_index, denominator, chunk_size, softcap, logit_divisor
    )
