"""How long ``engine.verify`` takes next to one training step, per phase, without a profiler.

For each row (``checkpoint:dtype:kernels:head|fused:sample|all``, as
:mod:`benchmarks.verify_memory` names them) one subprocess loads the model, patches it and,
on the same batch, times: a training step (forward + backward from cleared gradients, the
median of 3 after a warm-up), then ``engine.verify`` twice: the first call (which compiles
what its module checks force) and a warm one. Each phase of the warm call is timed by
wrapping the verification functions (wall clock; a phase called several times is summed):
the capturing forward, module and function checks, the original's, the patched and the fp64
truth's runs. ``compiled`` rows force the compiled code (``compiled.compiled_from(1)``), so the
patched model is not bit-equal and the truth runs (the worst case for time).

Pin it to one core on a quiet machine for ratios that mean something:

    taskset -c 0 env PYTHONPATH=. python benchmarks/verify_time.py --threads 1 \\
        --rows smollm2:fp32:compiled:head:sample --out benchmarks/results/verify_time.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def timed(name: str, fn: Callable[..., Any], into: dict[str, float], order: list[str]) -> Callable[..., Any]:
    """``fn``, adding its wall time to ``into[name]`` (``run`` calls are named original/patched/truth by order)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            key = name
            if name == "run":
                key = order.pop(0) if order else "run"
            into[key] = into.get(key, 0.0) + time.perf_counter() - start
    return wrapper


def one_row(row: str, threads: int) -> dict[str, Any]:
    """Time one row in this process."""
    name, dtype_name, kernels, head, modules = row.split(":")
    os.environ["PATCH_ENGINE_COMPILE"] = "1" if kernels == "compiled" else "0"
    import torch
    from verify_memory import PATCHSETS, load

    import engine
    from engine.verification import models, probes, runner

    torch.set_num_threads(threads)
    spent: dict[str, float] = {}
    order: list[str] = []
    models._run = timed("run", models._run, spent, order)
    models._truth_run = timed("truth_run", models._truth_run, spent, order)
    for module, fn in ((runner, "capture_inputs"), (runner, "verify_module"), (runner, "verify_function"),
                       (probes, "_decode_step"), (probes, "_vision_step")):
        if hasattr(module, fn):
            setattr(module, fn, timed(fn, getattr(module, fn), spent, order))
    forced = contextlib.ExitStack()
    if kernels == "compiled":
        from engine.kernels import compiled

        forced.enter_context(compiled.compiled_from(1))
    model, batch = load(name, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name])
    engine.apply(model, PATCHSETS[name], fused_cross_entropy=head == "fused")

    def step() -> float:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        out = model(**batch)
        out.loss.backward()
        took = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        return took

    step()
    steps = [step() for _ in range(3)]
    step_s = statistics.median(steps)
    calls = []
    for _ in range(2):
        spent.clear()
        order[:] = ["original", "patched", "truth"]
        start = time.perf_counter()
        report = engine.verify(model, batch=batch, modules=modules, raise_on_failure=False)
        calls.append((time.perf_counter() - start, dict(spent), report.passed))
    after = statistics.median(step() for _ in range(3))  # the machine's speed after, to see drift
    forced.close()
    (cold_s, _, _), (warm_s, phases, passed) = calls
    return {"row": row, "threads": threads, "tokens": list(batch["input_ids"].shape), "step_s": step_s,
            "steps_s": steps, "step_after_s": after, "verify_first_s": cold_s, "verify_warm_s": warm_s,
            "warm_over_step": warm_s / step_s, "phases_s": phases,
            "phases_over_step": {k: v / step_s for k, v in phases.items()}, "passed": passed,
            "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", default=["smollm2:fp32:compiled:head:sample"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print("ROW " + json.dumps(one_row(args.one, args.threads)), flush=True)
        return 0
    rows = []
    for row in args.rows:  # one process per row: compiles and allocator caches do not carry over
        proc = subprocess.run([sys.executable, __file__, "--one", row, "--threads", str(args.threads)], check=False,
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
        if proc.returncode or not lines:
            print(proc.stdout[-2000:], proc.stderr[-4000:], file=sys.stderr)
            return 1
        rows.append(json.loads(lines[-1][4:]))
        r = rows[-1]
        print(f"{row}: step {r['step_s']:.2f}s, verify first {r['verify_first_s']:.1f}s, warm {r['verify_warm_s']:.1f}s "
              f"= {r['warm_over_step']:.2f}x a step; phases (x a step): "
              + ", ".join(f"{k} {v:.2f}" for k, v in r["phases_over_step"].items()), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
