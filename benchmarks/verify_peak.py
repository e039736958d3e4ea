"""Where ``engine.verify``'s peak memory is on Gemma 3 270M: the allocator's running total per phase, and the ops at the peak.

A diagnostic for benchmarks/verify_cost.py (same model, batch and patchset): it wraps the
verification phases (the original / patched / truth runs, the module checks) in
``record_function`` markers, runs ``engine.verify`` once under
``torch.profiler(profile_memory=True)`` and prints, for each phase, the running total when it
starts and its maximum, and the ops enclosing the overall peak. Slow (the per-phase sums are
quadratic in the number of allocations): a few minutes.

    PYTHONPATH=. PATCH_ENGINE_COMPILE=0 flock /tmp/heavy.lock python benchmarks/verify_peak.py [sample|all]
"""
from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("PATCH_ENGINE_COMPILE", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from torch.profiler import ProfilerActivity, profile, record_function
from verify_cost import load_gemma, real_batch

import engine
from engine.verification import models, runner

MIB = 2**20


def marked(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function("PHASE " + name):
            return fn(*args, **kwargs)
    return wrapper


def main(modules: str) -> None:
    models._truth_run = marked("truth", models._truth_run)
    models._run = marked("run", models._run)
    for name in ("compare_models", "verify_function", "verify_module", "capture_inputs"):
        setattr(runner, name, marked(name, getattr(runner, name)))
    model, tokenizer = load_gemma(Path("/tmp/verify_cost"))
    model.train()
    batch = real_batch(tokenizer)
    engine.apply(model, "gemma3_text", device="cpu", fused_cross_entropy=True)
    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        report = engine.verify(model, batch=batch, modules=modules, raise_on_failure=False)
    raw = list(prof.profiler.kineto_results.events())
    mem = sorted((e.start_ns(), e.nbytes()) for e in raw if e.name() == "[memory]")
    level = peak = at = 0
    for t, n in mem:
        level += n
        if level > peak:
            peak, at = level, t
    print("passed", report.passed, "peak MiB", peak / MIB)
    for e in sorted((e for e in raw if e.name() != "[memory]" and e.start_ns() <= at <= e.end_ns()),
                    key=lambda e: e.start_ns()):
        print("  at peak:", e.name())
    for e in sorted((e for e in raw if e.name().startswith("PHASE")), key=lambda e: e.start_ns()):
        start = sum(n for t, n in mem if t < e.start_ns())
        running = highest = start
        for t, n in mem:
            if e.start_ns() <= t <= e.end_ns():
                running += n
                highest = max(highest, running)
        print(f"{e.name():40s} start {start / MIB:8.0f} max {highest / MIB:8.0f}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "sample")
