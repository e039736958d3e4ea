"""A changed module's backward judged on its recorded inputs: which module's gradients differ, and in what.

Why: a kernel whose forward computes the original's numbers can still return other gradients
(a scaled or in-place backward: Liger's RMSNorm with ``in_place=True`` under twinkle's replacement
overwrote the gradient it was given), and the whole-model gradient check says only that some
gradient differs. Here the patched module and the original one each run forward and backward on
the original's recorded inputs with the same cotangent; the gradients of every floating input and
every parameter they share are judged as ``verify`` judges a kernel (bit-equal, or within ``k``
times the original's own error against its fp64 truth: the original module under the verifier's fp64
mode on the same inputs, which also lifts the module's own casts to fp32). The original runs with the process as it was before the patch
(:meth:`engine.auditing.process_state.ProcessState.suspended`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine.verification.compare import cast_floats, clone_tensors, judge, max_abs_diff, move_tensors, tensors_of
from engine.verification.random_state import same_draws
from engine.verification.truth import GradientSink, fp64_truth

__all__ = ["BackwardResult", "judge_backward"]


class BackwardResult:
    """``differs``: the gradients that differ, by name, with their ratio to the original's own error."""

    def __init__(self) -> None:
        self.differs: dict[str, float] = {}
        #: gradients not bit-equal but within ``k`` of the original's own error, by name, with their ratio
        self.within: dict[str, float] = {}
        self.max_abs = 0.0
        self.problem: str | None = None
        #: its backward wrote into the gradient of its output it was given (Liger's ``in_place=True``): harmless
        #: where nothing else holds that gradient, wrong where a residual add hands it to a second branch
        #: (:mod:`engine.auditing.shared_gradients` asks the whole model which)
        self.writes_gradient = False

    def within_text(self) -> str:
        """A backward that passes without being bit-equal: which gradients, by how much."""
        worst = sorted(self.within.items(), key=lambda kv: -kv[1])
        shown = ", ".join(f"d{name} {ratio:.2g}x" for name, ratio in worst[:4])
        more = f" and {len(worst) - 4} more" if len(worst) > 4 else ""
        return f"forward same, backward not bit-equal (within its rounding error): {shown}{more} the original's own error"

    def text(self, forward: str = "same") -> str:
        if self.problem:
            return f"backward unchecked: {self.problem}"
        worst = sorted(self.differs.items(), key=lambda kv: -kv[1])
        shown = ", ".join(f"d{name} {ratio:.2g}x" for name, ratio in worst[:4])
        more = f" and {len(worst) - 4} more" if len(worst) > 4 else ""
        return f"forward {forward}, backward differs: {shown}{more} the original's own error"


def _gradients(module: nn.Module, args: Any, kwargs: Any, cotangents: list[torch.Tensor] | None,
               ) -> tuple[dict[str, torch.Tensor | None], list[torch.Tensor], bool]:
    """Forward and backward of ``module`` on copies of the inputs: gradients by name, the cotangents used, and
    whether the backward wrote into a cotangent it was handed."""
    a, k = clone_tensors(args), clone_tensors(kwargs)
    inputs = [t for t in tensors_of((a, k)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    for t in inputs:
        t.requires_grad_(True)
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    with torch.enable_grad(), same_draws(module):
        out = module(*a, **k)
    outs = [o for o in tensors_of(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    if cotangents is None:
        gen = torch.Generator().manual_seed(1234)
        cotangents = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]
    if not outs:
        return {}, cotangents, False
    wrt = inputs + list(params.values())
    given = [c.to(device=o.device, dtype=o.dtype, copy=True) for c, o in zip(cotangents, outs, strict=False)]
    kept = [g.clone() for g in given]
    grads = torch.autograd.grad(outs, wrt, given, allow_unused=True)
    wrote = any(not torch.equal(g, k) for g, k in zip(given, kept, strict=True))
    names = [f"input{i}" for i in range(len(inputs))] + [n for n in params]
    return {n: (g.detach() if g is not None else None) for n, g in zip(names, grads, strict=True)}, cotangents, wrote


def _truth(original: nn.Module, args: Any, kwargs: Any, cotangents: list[torch.Tensor]) -> dict[str, Any]:
    """The original's gradients in fp64: the verifier's fp64 mode (a module's own casts to fp32 included, which
    a float64 copy of the module would still make), inputs as fp64 leaves, parameters' fp64 gradients by the sink."""
    exact: dict[str, torch.Tensor] = {}
    sink = GradientSink(lambda name, g: exact.__setitem__(name, g.detach().double().clone()))
    a, k = cast_floats(clone_tensors(args), torch.float64), cast_floats(clone_tensors(kwargs), torch.float64)
    inputs = [t for t in tensors_of((a, k)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    for t in inputs:
        t.requires_grad_(True)
    params = {n: p for n, p in original.named_parameters() if p.requires_grad}
    with torch.enable_grad(), fp64_truth(original, sink), same_draws(original):
        out = original(*a, **k)
    outs = [o for o in tensors_of(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    grads = torch.autograd.grad(outs, inputs + list(params.values()),
                                [c.to(o.dtype).to(o.device) for c, o in zip(cotangents, outs, strict=False)],
                                allow_unused=True)
    found: dict[str, Any] = {f"input{i}": g for i, g in enumerate(grads[:len(inputs)])}
    for (name, _), g in zip(params.items(), grads[len(inputs):], strict=True):
        found[name] = exact.get(name, g)
    return found


def judge_backward(patched: nn.Module, original: nn.Module, rec: Any, device: torch.device,
                   original_process: Callable[[], contextlib.AbstractContextManager[Any]]) -> BackwardResult:
    """The patched module's gradients against the original's (and its fp64 truth) on the recorded inputs."""
    result = BackwardResult()
    args, kwargs = move_tensors(rec.args, device), move_tensors(rec.kwargs, device)
    try:
        with original_process():
            want, cot, _ = _gradients(original, args, kwargs, None)
            truth = _truth(original, args, kwargs, cot)
    except Exception as exc:  # noqa: BLE001  (an original without a backward here: nothing to compare with)
        result.problem = f"the original's backward raised {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        return result
    try:
        got, _, result.writes_gradient = _gradients(patched, args, kwargs, cot)
    except Exception as exc:  # noqa: BLE001  (a kernel whose backward cannot run here: unchecked, never passed)
        result.problem = f"the patched backward raised {type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        return result
    for name, w in want.items():
        if w is None or name not in got:
            continue  # a parameter the patched module does not have (a fused weight): the whole model judges it
        g, t = got[name], truth.get(name)
        if g is None:
            result.differs[name] = float("inf")
            continue
        if g.shape != w.shape:
            result.differs[name] = float("inf")
            continue
        diff = max_abs_diff(g, w)
        result.max_abs = max(result.max_abs, diff)
        if diff == 0:
            continue
        passed, _ = judge(g, w, t)
        noise = max_abs_diff(w, t) if t is not None else 0.0
        (result.within if passed else result.differs)[name] = diff / noise if noise else float("inf")
    return result
