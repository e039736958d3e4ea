"""Compiled kernels by rows: where compiling pays, and where the eager reference is faster (CPU).

Why: a compiled call has a fixed cost (dynamo's guards, the AOT wrapper) that a large input
hides and a small one does not; decode runs every norm and MLP product on one row per
sequence. This measures, per rows count, the torch reference (eager) against the compiled
function called directly (no eager cut-off), no grad, fp32 and bf16, interleaved, median of
``--repeats``; it is what ``engine.kernels.compiled.EAGER_BELOW_ROWS`` is set from.

    flock /tmp/heavy.lock python benchmarks/compiled_shapes.py

Writes ``benchmarks/results/compiled_shapes_cpu.json`` and the "compiled-shapes" section of
``benchmarks/results/cpu.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from engine import results_sections
from engine.kernels import compiled, registry
from engine.ops.rms_norm import rms_norm_reference
from engine.ops.swiglu import silu_mul_reference
from engine.schema import CastOrder, RmsNormPatch, Scale

ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 512)
SECTION = "compiled-shapes"


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


def run(repeats: int, inner: int) -> list[dict[str, Any]]:
    os.environ[compiled.ENV_SWITCH] = "1"
    norm_patch = RmsNormPatch(target="N", op="rms_norm", scale=Scale.one_plus_weight, cast=CastOrder.fp32)
    norm = registry.get("compiled", "rms_norm").build(norm_patch).kernel
    swiglu = registry.get("compiled", "swiglu").build(None).kernel
    rows_out = []
    for dtype in (torch.float32, torch.bfloat16):
        for op, width in (("rms_norm", 576), ("rms_norm", 640), ("swiglu", 1536)):
            for rows in ROWS:
                gen = torch.Generator().manual_seed(rows)
                a = torch.randn(rows, width, generator=gen).to(dtype)
                if op == "rms_norm":
                    w = (0.1 * torch.randn(width, generator=gen)).to(dtype)
                    fns = {"eager": lambda a=a, w=w: rms_norm_reference(a, w, 1e-6, scale=norm_patch.scale,
                                                                         cast=norm_patch.cast),
                           "compiled": lambda a=a, w=w: norm(a, w, 1e-6)}
                else:
                    b = torch.randn(rows, width, generator=gen).to(dtype)
                    fns = {"eager": lambda a=a, b=b: silu_mul_reference(a, b),
                           "compiled": lambda a=a, b=b: swiglu(a, b)}
                with torch.no_grad():
                    t = _time(fns, repeats, inner if rows <= 128 else max(1, inner // 10))
                row = {"op": op, "width": width, "dtype": str(dtype).removeprefix("torch."), "rows": rows,
                       "eager_us": t["eager"], "compiled_us": t["compiled"], "speedup": t["eager"] / t["compiled"]}
                rows_out.append(row)
                print(json.dumps(row), flush=True)
    return rows_out


def markdown(results: dict[str, Any]) -> str:
    rows = results["rows"]
    keys = sorted({(r["op"], r["width"], r["dtype"]) for r in rows}, key=lambda k: (k[0], k[1], k[2] != "float32"))
    counts = sorted({r["rows"] for r in rows})
    out = ["### Compiled kernels by rows (decode vs prefill shapes)", "",
           ("Written by `flock /tmp/heavy.lock python benchmarks/compiled_shapes.py`: the torch reference (eager) vs "
            "the compiled function called directly, no grad, interleaved, median of "
            f"{results['repeats']} loops of {results['inner']} calls; torch {results['torch']}, "
            f"{results['threads']} threads. Cells: eager / compiled microseconds per call (speed-up). "
            f"`EAGER_BELOW_ROWS` = {results['eager_below_rows']}: fewer rows run the reference eagerly."), "",
           "| op | width | dtype | " + " | ".join(f"{n} rows" for n in counts) + " |",
           "|---|---|---|" + "---|" * len(counts)]
    for op, width, dtype in keys:
        cells = []
        for n in counts:
            r = next(r for r in rows if (r["op"], r["width"], r["dtype"], r["rows"]) == (op, width, dtype, n))
            cells.append(f"{r['eager_us']:.0f} / {r['compiled_us']:.0f} ({r['speedup']:.2f}x)")
        out.append(f"| {op} | {width} | {dtype} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--inner", type=int, default=200, help="calls per timed loop")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/compiled_shapes_cpu.json"))
    parser.add_argument("--md", type=Path, default=Path("benchmarks/results/cpu.md"))
    args = parser.parse_args(argv)
    results = {"torch": torch.__version__, "threads": torch.get_num_threads(), "repeats": args.repeats,
               "inner": args.inner, "eager_below_rows": compiled.EAGER_BELOW_ROWS, "rows": run(args.repeats, args.inner)}
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    results_sections.write_section(args.md, markdown(results), SECTION)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
