"""The original model evaluated in fp64, without an fp64 copy of it: the truth the judge measures against.

Why not ``copy.deepcopy(model).double()``: it costs twice the model's memory, and it is not an
fp64 evaluation anyway. transformers rounds to fp32 inside its norms
(``hidden_states.to(torch.float32)``), before the loss (``logits.float()``), in eager attention
(``softmax(..., dtype=torch.float32)``), so a model cast to fp64 is rounded to fp32 exactly where
transformers' own fp32 model is, and the "truth" flatters the original.

:class:`Fp64` is a ``TorchFunctionMode`` active only during the truth run. For every torch call it

* upcasts every floating-point tensor argument to fp64, one op at a time (a parameter's fp64
  copy lives for the op that uses it; when autograd must save it for the backward, a
  ``saved_tensors_hooks`` pair saves a reference to the fp32 parameter instead and upcasts it
  again when the backward needs it, so the graph never keeps fp64 parameters alive);
* turns every cast to a lower float dtype into a no-op on fp64 tensors: ``.float()``,
  ``.half()``, ``.bfloat16()``, and any ``dtype`` argument (``.to(torch.float32)``,
  ``.type(...)``, ``softmax(dtype=torch.float32)``, ``torch.zeros(dtype=...)``) becomes fp64;
* never upcasts a large parameter (over :data:`_BIG` elements) whole: ``F.embedding`` upcasts
  the looked-up rows, ``F.linear`` blocks of the weight in turn (:class:`_WideRows`,
  :class:`_WideLinear`: Gemma 3's tied 262k x 640 embedding is 1.3 GiB in fp64), and a
  cross-entropy of large ``[tokens, vocab]`` scores runs a block of rows at a time without
  keeping its log-softmax (:class:`_WideCrossEntropy`);
* counts any floating-point result that is still not fp64 (:attr:`Fp64.rounded`), so a caller
  can check that nothing rounded (tests assert it is empty).

A trainable parameter's gradient is not accumulated into its ``.grad``: each use of the
parameter goes through :class:`_Upcast`, whose backward hands the fp64 gradient of that use to
a :class:`GradientSink`, which sums the uses of one parameter and calls back once the last
use has arrived; the caller compares it and lets it go. So at most the parameters whose uses
are still outstanding (a tied embedding: from the head to the input lookup) hold an fp64
gradient at a time.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from engine.verification.truth_sink import GradientSink

__all__ = ["Fp64", "GradientSink", "fp64_truth"]

_LOWER = (torch.float32, torch.float16, torch.bfloat16)
_DOWNCASTS = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16}
#: Calls that read metadata: their float arguments are left as they are (no upcast copy).
_METADATA = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.stride,
             torch.Tensor.is_floating_point, torch.Tensor.element_size, torch.Tensor.data_ptr,
             torch.Tensor.is_contiguous, torch.Tensor.storage_offset, torch.Tensor.__len__,
             torch.Tensor.requires_grad_, torch.Tensor.register_hook, torch.Tensor.untyped_storage}


#: Tensor properties that are views of it: on a parameter, taken from its fp64 upcast (:meth:`Fp64.__torch_function__`).
_VIEW_PROPERTIES = {"T", "mT", "H", "mH"}


def _in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in _IN_PLACE_DUNDER


_IN_PLACE_DUNDER = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ior__", "__iand__"}


class _Upcast(torch.autograd.Function):
    """``p.to(float64)`` whose backward hands the fp64 gradient to a sink instead of ``p.grad``."""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor, sink: GradientSink, name: str) -> torch.Tensor:  # type: ignore[override]
        ctx.sink, ctx.name = sink, name
        return p.detach().to(torch.float64)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:  # type: ignore[override]
        ctx.sink.receive(ctx.name, grad)
        return None, None, None


#: A parameter with more elements than this is never upcast whole by a lookup or a linear layer:
#: a 262k-token embedding tied to the head is 1.3 GiB in fp64 (see :class:`_WideRows`, :class:`_WideLinear`).
_BIG = 1 << 22


class _WideRows(torch.autograd.Function):
    """``F.embedding`` in fp64 from the looked-up rows only; the gradient reaches the sink as rows."""

    @staticmethod
    def forward(ctx: Any, p: torch.Tensor, ids: torch.Tensor, padding_idx: int | None,  # type: ignore[override]
                sink: GradientSink | None, name: str) -> torch.Tensor:
        ctx.ids, ctx.padding_idx, ctx.sink, ctx.name, ctx.shape = ids, padding_idx, sink, name, p.shape
        return p.detach()[ids].to(torch.float64)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, ...]:  # type: ignore[override]
        ids, rows = ctx.ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:  # as F.embedding: the padding row gets no gradient
            rows = rows.masked_fill((ids == ctx.padding_idx).unsqueeze(-1), 0.0)
        ctx.sink.receive_rows(ctx.name, ids, rows, ctx.shape)
        return None, None, None, None, None


class _WideLinear(torch.autograd.Function):
    """``F.linear`` in fp64 with the weight upcast a block of output rows at a time (a huge LM head)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, p: torch.Tensor, bias: torch.Tensor | None,  # type: ignore[override]
                sink: GradientSink | None, name: str) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.p, ctx.sink, ctx.name, ctx.has_bias = p, sink, name, bias is not None
        w = p.detach()
        out = x.new_empty(*x.shape[:-1], w.shape[0])
        for s, block in _blocks(w):
            out[..., s:s + block.shape[0]] = x @ block.T
        return out if bias is None else out.add_(bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        w = ctx.p.detach()
        g, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
        grad_x = x2.new_zeros(x2.shape)
        if ctx.sink is not None and ctx.sink.streams(ctx.name):  # the weight's gradient never whole
            def parts() -> Iterator[tuple[int, torch.Tensor]]:
                for s, block in _blocks(w):
                    gs = g[:, s:s + block.shape[0]]
                    grad_x.addmm_(gs, block)
                    yield s, gs.T @ x2
            ctx.sink.receive_blocks(ctx.name, w.shape[0], parts())
            return grad_x.reshape(x.shape), None, g.sum(0) if ctx.has_bias else None, None, None
        grad_w = x2.new_empty(w.shape) if ctx.sink is not None else None
        for s, block in _blocks(w):
            gs = g[:, s:s + block.shape[0]]
            grad_x.addmm_(gs, block)
            if grad_w is not None:
                torch.mm(gs.T, x2, out=grad_w[s:s + block.shape[0]])
        if grad_w is not None:
            ctx.sink.receive(ctx.name, grad_w, owned=True)
        return grad_x.reshape(x.shape), None, g.sum(0) if ctx.has_bias else None, None, None


class _WideCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy`` of ``[tokens, vocab]`` fp64 scores a block of rows at a time: no log-softmax is kept.

    Why: torch's keeps its ``[tokens, vocab]`` log-softmax for the backward and makes two more of
    that size there; in fp64 (Gemma 3's 262k vocabulary, 320 tokens: 640 MiB each) they were
    the truth's peak. Here the forward keeps one logsumexp per row, and the backward writes the
    scores' gradient ``(softmax - onehot) * scale`` block by block, into the scores themselves
    when nothing else can read them any more (:meth:`Fp64.scores_free`): then the truth's head
    holds one ``[tokens, vocab]`` fp64 tensor, not two.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, target: torch.Tensor, ignore: int, reduction: str,  # type: ignore[override]
                mode: Fp64 | None = None) -> torch.Tensor:
        valid = target != ignore
        safe = target.masked_fill(~valid, 0)
        lse = x.new_empty(x.shape[0])
        for s, e in _row_blocks(x):
            lse[s:e] = torch.logsumexp(x[s:e], dim=-1)
        losses = (lse - x.gather(1, safe.unsqueeze(1)).squeeze(1)).masked_fill(~valid, 0.0)
        ctx.save_for_backward(x, lse, safe, valid)
        ctx.reduction, ctx.mode = reduction, mode
        if reduction == "none":
            return losses
        return losses.sum() if reduction == "sum" else losses.sum() / valid.sum()  # all ignored: nan, as torch

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, lse, safe, valid = ctx.saved_tensors
        if ctx.reduction == "none":
            scale = grad * valid
        else:
            scale = (grad if ctx.reduction == "sum" else grad / valid.sum()).expand(x.shape[0]) * valid
        out = x.detach() if ctx.mode is not None and ctx.mode.scores_free(x) else torch.empty_like(x)
        for s, e in _row_blocks(x):  # each block read before it is written: in place is exact
            block = torch.exp(x[s:e] - lse[s:e, None])
            block.scatter_add_(1, safe[s:e, None], block.new_full((e - s, 1), -1.0))
            out[s:e] = block.mul_(scale[s:e, None])
        return out, None, None, None, None


def _row_blocks(x: torch.Tensor) -> Iterator[tuple[int, int]]:
    step = max(1, (_BIG // 8) // max(1, x.shape[-1]))
    for s in range(0, x.shape[0], step):
        yield s, min(s + step, x.shape[0])


def _blocks(w: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """``(first row, rows in fp64)`` of ``w``, about :data:`_BIG` / 8 elements at a time."""
    step = max(1, (_BIG // 8) // max(1, w.shape[-1]))
    for s in range(0, w.shape[0], step):
        yield s, w[s:s + step].to(torch.float64)


def _grouped_mm(
    a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
    out_dtype: Any = None,
) -> Any:
    """``grouped_mm`` in fp64 (torch's kernel has none): rows ``offs[g-1]:offs[g]`` of ``a`` times ``b[g]``."""
    if bias is not None or offs is None or a.dim() != 2 or b.dim() != 3:
        raise NotImplementedError(f"grouped_mm in fp64 for these arguments ({a.dim()}D x {b.dim()}D)")
    ends = offs.tolist()
    parts, start = [], 0
    for g, end in enumerate(ends):
        parts.append(a[start:end] @ b[g])
        start = end
    if start < a.shape[0]:  # rows past the last group: zeros, as the kernel leaves them
        parts.append(a.new_zeros(a.shape[0] - start, b.shape[-1]))
    return torch.cat(parts)


#: Calls whose torch kernel has no fp64: an fp64 equivalent built from calls that have one.
_FP64_EQUIVALENTS: dict[Any, Callable[..., Any]] = {
    f: _grouped_mm for f in (getattr(torch, "_grouped_mm", None), getattr(torch.nn.functional, "grouped_mm", None))
    if f is not None
}


class _ParamRef:
    """What autograd saves instead of (a view of) an upcast parameter: the parameter and the view's geometry."""

    __slots__ = ("geometry", "param")

    def __init__(self, param: torch.Tensor, geometry: tuple[Any, ...]):
        self.param, self.geometry = param, geometry


class Fp64(TorchFunctionMode):
    """Run torch calls in fp64, with lower-precision casts as no-ops (see the module docstring).

    Args:
        params: ``{id(parameter): (name, parameter)}`` of the model; trainable ones (with grad
            enabled and a ``sink``) send their fp64 gradients to ``sink``.
        sink: where parameter gradients go; ``None`` under ``torch.no_grad``.
    """

    def __init__(self, params: dict[int, tuple[str, nn.Parameter]], sink: GradientSink | None = None):
        super().__init__()
        self.params = params
        self.sink = sink
        self.rounded: dict[str, int] = {}
        self._upcasts: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        #: inside a layer run without a graph that its backward recomputes (:mod:`.truth_layers`): uses are
        #: counted now (the sink must know every use before the first gradient arrives) ...
        self.counting = False
        #: ... and not again in the recomputation, which builds the graph the gradients come from
        self.recomputing = False
        #: set by the caller once it holds none of the run's outputs (see :meth:`scores_free`)
        self.outputs_dropped = False
        #: how many times each storage was saved for the backward during the run (see :meth:`pack`)
        self._saved: collections.Counter[int] = collections.Counter()

    def _sink_for(self, param: torch.Tensor) -> GradientSink | None:
        """The sink when this use of ``param`` sends it a gradient now; ``None`` otherwise."""
        if self.sink is None or not param.requires_grad:
            return None
        return self.sink if torch.is_grad_enabled() else None

    def _use(self, name: str, param: torch.Tensor, ids: torch.Tensor | None = None) -> None:
        """Count one use of a trainable ``param`` with the sink (once: not again when recomputed)."""
        if self.sink is not None and param.requires_grad and not self.recomputing and (
                torch.is_grad_enabled() or self.counting):
            self.sink.used(name, ids)

    @contextlib.contextmanager
    def scope(self) -> Iterator[Fp64]:
        """The mode active, with fp64 as default dtype and parameters saved by reference (entered again to recompute)."""
        default = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)  # ``torch.zeros(shape)`` and ``torch.tensor(0.5)`` too
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack), self:
                yield self
        finally:
            torch.set_default_dtype(default)

    def _up(self, value: Any) -> Any:
        if isinstance(value, torch.dtype):
            return torch.float64 if value in _LOWER else value
        if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.dtype == torch.float64:
            return value
        entry = self.params.get(id(value))
        if entry is None:
            return value.to(torch.float64)
        name, param = entry
        self._use(name, param)
        if self._sink_for(param) is not None:
            wide = _Upcast.apply(param, self.sink, name)
        else:
            wide = param.detach().to(torch.float64)
        self._upcasts[id(wide)] = (weakref.ref(wide), param)
        return wide

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "__get__" and args and id(args[0]) in self.params and getattr(
                getattr(func, "__self__", None), "__name__", "") in _VIEW_PROPERTIES:
            # ``self.weight.T`` (Falcon's linear): the view of the parameter's fp64 upcast, so its gradient reaches the
            # sink; the view of the fp32 parameter would be upcast as a plain tensor, its gradient lost to ``.grad``
            return getattr(self._up(args[0]), func.__self__.__name__)
        if func in _METADATA or getattr(func, "__name__", "") in ("__get__", "__set__"):
            return func(*args, **kwargs)
        if func in _DOWNCASTS and args and isinstance(args[0], torch.Tensor):
            x = args[0]  # ``ids.float()``: an integer tensor becomes fp64 (exact below 2**53)
            return self._up(x) if x.is_floating_point() else x.to(torch.float64)
        wide = self._wide(func, args, kwargs)
        if wide is not None:
            return wide
        if _in_place(func) and args and isinstance(args[0], torch.Tensor):
            # ``t.add_(...)``, ``t[i] = v``: the result must land in ``t`` itself, not in an upcast copy
            rest, kwargs = tree_map(self._up, (args[1:], kwargs))
            args = (args[0], *rest)
        else:
            original = (args, kwargs)
            args, kwargs = tree_map(self._up, (args, kwargs))
            try:
                return self._count(func, _FP64_EQUIVALENTS.get(func, func)(*args, **kwargs))
            except (RuntimeError, NotImplementedError):  # a kernel without fp64: as the original (named in ``rounded``)
                return self._count(func, func(*original[0], **original[1]))
        out = func(*args, **kwargs)
        return self._count(func, out)

    def _wide(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
        """A lookup in, or a linear layer by, a large parameter, without its whole fp64 copy; ``None``: not one."""
        if func is torch.nn.functional.cross_entropy:
            return self._cross_entropy(args, kwargs)
        if func is torch.nn.functional.embedding:
            names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq",
                            "sparse")
        elif func is torch.nn.functional.linear:
            names = ("input", "weight", "bias")
        else:
            return None
        bound = dict(zip(names, args, strict=False)) | kwargs
        entry = self.params.get(id(bound.get("weight")))
        if entry is None or entry[1].numel() <= _BIG:
            return None
        name, param = entry
        sink = self._sink_for(param)
        if func is torch.nn.functional.embedding:
            if bound.get("max_norm") is not None or bound.get("scale_grad_by_freq") or bound.get("sparse"):
                return None
            padding = bound.get("padding_idx")
            if padding is not None and padding < 0:
                padding += param.shape[0]
            self._use(name, param, bound["input"])
            if sink is not None:
                return _WideRows.apply(param, bound["input"], padding, sink, name)
            return param.detach()[bound["input"]].to(torch.float64)
        x, bias = self._up(bound["input"]), self._up(bound.get("bias"))
        self._use(name, param)
        return _WideLinear.apply(x, param, bias, sink, name)

    def _cross_entropy(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
        """Class-index cross-entropy of large ``[tokens, vocab]`` scores, blockwise; ``None``: another kind."""
        names = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")
        b = dict(zip(names, args, strict=False)) | kwargs
        x, target = b.get("input"), b.get("target")
        if (not isinstance(x, torch.Tensor) or not isinstance(target, torch.Tensor) or x.dim() != 2
                or target.dim() != 1 or target.is_floating_point() or x.numel() <= _BIG
                or b.get("weight") is not None or b.get("size_average") is not None or b.get("reduce") is not None
                or b.get("label_smoothing", 0.0) or b.get("reduction", "mean") not in ("mean", "sum", "none")):
            return None
        return _WideCrossEntropy.apply(self._up(x), target, b.get("ignore_index", -100), b.get("reduction", "mean"), self)

    def _count(self, func: Any, out: Any) -> Any:
        if isinstance(out, torch.Tensor) and out.is_floating_point() and out.dtype != torch.float64:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
            self.rounded[name] = self.rounded.get(name, 0) + 1
        return out


    # ---- saved tensors: a reference to the parameter, not its fp64 copy ----------------------

    def pack(self, tensor: torch.Tensor) -> Any:
        base = tensor._base if tensor._base is not None else tensor
        entry = self._upcasts.get(id(base))
        if entry is not None and entry[0]() is base:
            return _ParamRef(entry[1], (tensor.size(), tensor.stride(), tensor.storage_offset()))
        if tensor.is_floating_point() and tensor.layout == torch.strided:  # (a sparse tensor has no storage)
            self._saved[tensor.untyped_storage().data_ptr()] += 1
        return tensor

    def scores_free(self, scores: torch.Tensor) -> bool:
        """Whether the cross-entropy's backward may overwrite ``scores``: nothing else can read them.

        True only when the caller has dropped the run's outputs (:attr:`outputs_dropped`: the
        logits are a view of the same storage) and no other backward saved that storage (a
        z-loss's ``logsumexp`` of the logits, say): then the cross-entropy's own saved reference
        is the last reader. A storage freed and reused counts as saved too: a fresh buffer, never a
        wrong one.
        """
        return self.outputs_dropped and self._saved[scores.untyped_storage().data_ptr()] <= 1

    @staticmethod
    def unpack(saved: Any) -> torch.Tensor:
        if isinstance(saved, _ParamRef):
            return saved.param.detach().to(torch.float64).as_strided(*saved.geometry)
        return saved


class fp64_truth:
    """Inside the block, ``model`` (and any torch code) computes in fp64; ``as`` gives the mode (see :class:`Fp64`).

    The backward may run after the block: what the forward saved refers to the fp32
    parameters, and their gradients reach ``sink`` whenever autograd computes them.
    """

    def __init__(self, model: nn.Module | None, sink: GradientSink | None = None):
        params = {id(p): (name, p) for name, p in model.named_parameters()} if model is not None else {}
        self.mode = Fp64(params, sink)
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> Fp64:
        with contextlib.ExitStack() as stack:
            stack.callback(self.mode._upcasts.clear)
            stack.enter_context(self.mode.scope())
            self._stack = stack.pop_all()
        return self.mode

    def __exit__(self, *exc: object) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.__exit__(*exc)
