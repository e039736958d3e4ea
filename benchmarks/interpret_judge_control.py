"""Is an interpreted RMSNorm failure the kernel or the judge? Liger's RMSNorm next to two controls.

For a patchset whose interpreted CUDA plan fails the whole-model gradient check on one short
sequence (glm4v: 8 tokens), each batch (``--seeds``) is run four ways on the same tiny fp32 model:
the original, the CUDA plan with liger's RMSNorm (Triton's interpreter), and the same plan with
liger's RMSNorm swapped for (a) ``exact``: the norm in fp64, rounded to fp32 once (the most accurate
kernel there is) and (b) ``reversed``: transformers' own formula on the columns in reverse order (as
accurate as the original, rounded independently: only the order of the mean's sum differs). Each
parameter gradient is judged as the verifier does (``|patched - original| <= 3 x |original - fp64|
+ 1 ulp``, small tensors at least the model's median level), and ``far/noise`` says how much further
from fp64 the patched gradient is than the original's. When ``reversed`` fails on the same batch as
liger, the failure is the judge's sample (the original luckily exact on that batch), not the kernel.

    python benchmarks/interpret_judge_control.py glm4v --seq 8 --seeds 0,1,2,3,4,5,6,7,8,9
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch


class _Exact(torch.autograd.Function):
    """RMSNorm, llama cast order, in fp64 and rounded once (forward and input/weight gradients)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, eps: float, offset: float, mode: str,
                in_place: bool) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.eps, ctx.offset = eps, offset
        return _norm64(x.double(), w.double() + offset, eps).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        with torch.enable_grad():
            xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
            gx, gw = torch.autograd.grad(_norm64(xd, wd + ctx.offset, ctx.eps), (xd, wd), g.double())
        return gx.to(x.dtype), gw.to(w.dtype), None, None, None, None


def _norm64(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _reversed(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float, mode: str, in_place: bool) -> torch.Tensor:
    """transformers' llama-order RMSNorm on the columns in reverse order."""
    h = x.flip(-1).float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return ((w.flip(-1) + offset) * h.to(x.dtype)).flip(-1)


def _grads(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from engine.verification.models import _run

    for p in model.parameters():
        p.grad = None
    _run(model, batch)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _truth(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from engine.verification.models import _no_checkpointing, _run
    from engine.verification.truth import GradientSink, fp64_truth

    got: dict[str, torch.Tensor] = {}
    sink = GradientSink(lambda name, g: got.__setitem__(name, g.detach().clone()))
    with _no_checkpointing(model):
        _run(model, batch, forward_in=fp64_truth(model, sink))
    sink.flush()
    for p in model.parameters():
        p.grad = None
    return got


def judged(got: dict[str, torch.Tensor], orig: dict[str, torch.Tensor], truth: dict[str, torch.Tensor],
           sizes: dict[str, int]) -> dict[str, tuple[float, float]]:
    """``name -> (diff / allowed, far / noise)`` as the verifier's gradient check judges (ratio > 1 fails)."""
    from engine.verification.compare import allowed
    from engine.verification.verdicts import SMALL_TENSOR

    def err(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b.double()).abs().max())

    levels = sorted(err(orig[n], truth[n]) / float(truth[n].abs().max()) for n in orig if truth[n].abs().max() > 0)
    level = levels[len(levels) // 2]
    out = {}
    for name, original in orig.items():
        scale = float(truth[name].abs().max())
        noise = err(original, truth[name])
        if sizes[name] <= SMALL_TENSOR:
            noise = max(noise, level * scale)
        limit = allowed(noise, scale, torch.float32)
        diff = err(got[name], original)
        out[name] = (diff / limit if limit else (0.0 if diff == 0 else math.inf),
                     err(got[name], truth[name]) / noise if noise else math.inf)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("patchset")
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--seeds", default="0,1,2,3,4,5,6,7,8,9")
    args = parser.parse_args(argv)

    import liger_kernel.ops.rms_norm as liger_rms

    from engine.api import apply, revert
    from engine.kernels.triton_interpret import interpreting
    from engine.loader import load_patchset
    from engine.tiny import build_tiny_for
    from engine.verification import probe_batch

    torch.set_num_threads(1)
    ps = load_patchset(args.patchset)
    model = build_tiny_for(ps, None, dtype=torch.float32)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    original_apply = liger_rms.LigerRMSNormFunction.apply
    for seed in (int(s) for s in args.seeds.split(",")):
        batch = probe_batch(model, batch=1, seq=args.seq, seed=seed)
        orig, truth = _grads(model, batch), _truth(model, batch)
        for variant, norm in (("liger", original_apply), ("exact", _Exact.apply), ("reversed", _reversed)):
            liger_rms.LigerRMSNormFunction.apply = norm
            try:
                with interpreting():
                    apply(model, ps, device="cuda")
                    try:
                        got = _grads(model, batch)
                    finally:
                        revert(model)
            finally:
                liger_rms.LigerRMSNormFunction.apply = original_apply
            rows = judged(got, orig, truth, sizes)
            worst = max(rows, key=lambda n: rows[n][0])
            failing = sum(r[0] > 1 for r in rows.values())
            print(f"seq={args.seq} seed={seed} {variant:8s} failing={failing}/{len(rows)} worst {worst}: "
                  f"diff/allowed {rows[worst][0]:.2f} (fails above 1), far/noise {rows[worst][1]:.2f}")


if __name__ == "__main__":
    main()
