"""Compiled kernels by rows: where compiling pays, and where the eager reference is faster (CPU).

Why: a compiled call has a fixed cost (dynamo's guards, the AOT wrapper) that a large input
hides and a small one does not; decode runs every norm and MLP product on one row per
sequence. This measures, per rows count, the torch reference (eager) against the compiled
function called directly (no rule, no eager cut-off), for the norms and gated products of the
two real checkpoints, without gradients and with them (forward + backward), fp32 and bf16,
interleaved, median of ``--repeats``, with the load average of each row; it is what the rule
``auto`` applies (``engine/_data/compiled_rows.yaml``) is set from.

    python benchmarks/compiled_shapes.py --repeats 5 --inner 100

Writes ``benchmarks/results/compiled_shapes_cpu.json`` and the "compiled-shapes" section of
``benchmarks/results/cpu.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine.commands import results_sections
from engine.kernels import compiled, registry
from engine.ops.geglu import gelu_mul_reference
from engine.ops.rms_norm import rms_norm_reference
from engine.ops.swiglu import silu_mul_reference
from engine.schema import CastOrder, GegluPatch, RmsNormPatch, Scale

ROWS = (1, 4, 16, 64, 256, 1024, 4096)
SECTION = "compiled-shapes"
#: (op, width, norm scale): the norms and gated products of the two real checkpoints (SmolLM2-135M:
#: hidden 576, MLP 1536, llama-style norm; Gemma 3 270M: hidden 640, MLP 2048, per-head q/k norm of
#: width 256, ``1 + w`` norms, GeGLU).
SHAPES = (("rms_norm", 576, Scale.weight), ("swiglu", 1536, None),
          ("rms_norm", 640, Scale.one_plus_weight), ("rms_norm", 256, Scale.one_plus_weight), ("geglu", 2048, None))


def _time(fns: dict[str, Any], repeats: int, inner: int) -> dict[str, float]:
    """Median microseconds per call, the functions interleaved in loops of ``inner`` calls."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            times[name].append((time.perf_counter() - start) / inner * 1e6)
    return {k: statistics.median(v) for k, v in times.items()}


def _kernels(scale: Scale | None) -> dict[str, tuple[Any, Any]]:
    """op -> (the torch reference, the compiled function called directly: no eager cut-off)."""
    patch = RmsNormPatch(target="N", op="rms_norm", scale=scale or Scale.weight,
                         cast=CastOrder.fp32 if scale is Scale.one_plus_weight else CastOrder.llama)
    norm = registry.get("compiled", "rms_norm").build(patch).kernel
    return {
        "rms_norm": (lambda a, w: rms_norm_reference(a, w, 1e-6, scale=patch.scale, cast=patch.cast),
                     lambda a, w: norm(a, w, 1e-6)),
        "swiglu": (silu_mul_reference, registry.get("compiled", "swiglu").build(None).kernel),
        "geglu": (lambda g, u: gelu_mul_reference(g, u, "tanh"),
                  registry.get("compiled", "geglu").build(GegluPatch(target="M", op="geglu")).kernel),
    }


def _call(fn: Any, inputs: tuple[torch.Tensor, ...], grad: bool, out_grad: torch.Tensor | None) -> Any:
    """One forward (no grad), or one forward + backward from fresh leaves (a training step's share)."""
    if not grad:
        return lambda: fn(*inputs)

    def step() -> None:
        leaves = [t.detach().requires_grad_() for t in inputs]
        fn(*leaves).backward(out_grad)

    return step


def run(repeats: int, inner: int, rows_list: tuple[int, ...], grads: tuple[bool, ...],
        dtypes: tuple[torch.dtype, ...]) -> list[dict[str, Any]]:
    os.environ[compiled.ENV_SWITCH] = "1"
    rows_out = []
    for grad in grads:
        for dtype in dtypes:
            for op, width, scale in SHAPES:
                eager, fast = _kernels(scale)[op]
                for rows in rows_list:
                    gen = torch.Generator().manual_seed(rows)
                    a = torch.randn(rows, width, generator=gen).to(dtype)
                    b = ((0.1 * torch.randn(width, generator=gen)) if op == "rms_norm"
                         else torch.randn(rows, width, generator=gen)).to(dtype)
                    out_grad = torch.randn(rows, width, generator=gen).to(dtype) if grad else None
                    fns = {"eager": _call(eager, (a, b), grad, out_grad), "compiled": _call(fast, (a, b), grad, out_grad)}
                    calls = max(1, inner * 16 // max(rows, 16))
                    with torch.set_grad_enabled(grad):
                        t = _time(fns, repeats, calls)
                    row = {"op": op, "width": width, "dtype": str(dtype).removeprefix("torch."), "grad": grad,
                           "rows": rows, "eager_us": t["eager"], "compiled_us": t["compiled"],
                           "speedup": t["eager"] / t["compiled"], "load_average": os.getloadavg()[0]}
                    rows_out.append(row)
                    print(json.dumps(row), flush=True)
    return rows_out


def markdown(results: dict[str, Any]) -> str:
    rows = results["rows"]
    keys = sorted({(r["grad"], r["op"], r["width"], r["dtype"]) for r in rows},
                  key=lambda k: (k[0], k[1], k[2], k[3] != "float32"))
    counts = sorted({r["rows"] for r in rows})
    loads = [r["load_average"] for r in rows]
    out = ["### Compiled kernels by rows (decode vs prefill shapes)", "",
           (f"Written by `{results['command']}`: the torch reference (eager) vs the compiled function called "
            "directly (no eager cut-off), without gradients (forward) and with them (forward + backward from "
            f"fresh leaves), interleaved, median of {results['repeats']} loops; torch {results['torch']}, "
            f"{results['threads']} threads; load average {min(loads):.1f}-{max(loads):.1f} during the run. "
            "Cells: eager / compiled microseconds per call (speed-up). The rule `auto` applies is "
            "`engine/_data/compiled_rows.yaml`, set from this table."), "",
           "| pass | op | width | dtype | " + " | ".join(f"{n} rows" for n in counts) + " |",
           "|---|---|---|---|" + "---|" * len(counts)]
    for grad, op, width, dtype in keys:
        cells = []
        for n in counts:
            r = next((r for r in rows if (r["grad"], r["op"], r["width"], r["dtype"], r["rows"])
                      == (grad, op, width, dtype, n)), None)
            cells.append("-" if r is None else f"{r['eager_us']:.0f} / {r['compiled_us']:.0f} ({r['speedup']:.2f}x)")
        out.append(f"| {'fwd+bwd' if grad else 'forward'} | {op} | {width} | {dtype} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--inner", type=int, default=200, help="calls per timed loop at 16 rows (fewer at more rows)")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--passes", nargs="+", default=["forward", "fwd+bwd"], choices=["forward", "fwd+bwd"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/compiled_shapes_cpu.json"))
    parser.add_argument("--md", type=Path, default=Path("benchmarks/results/cpu.md"))
    args = parser.parse_args(argv)
    command = "python benchmarks/compiled_shapes.py " + " ".join(argv if argv is not None else sys.argv[1:])
    rows = run(args.repeats, args.inner, tuple(args.rows), tuple(p == "fwd+bwd" for p in args.passes),
               tuple(getattr(torch, d) for d in args.dtypes))
    results = {"command": command.strip(), "torch": torch.__version__, "threads": torch.get_num_threads(),
               "repeats": args.repeats, "inner": args.inner, "rows": rows}
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    results_sections.write_section(args.md, markdown(results), SECTION)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
