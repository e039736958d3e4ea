"""Where ``engine.verify``'s peak memory is on Gemma 3 270M: the allocator's running total per phase, and the ops at the peak.

A diagnostic for benchmarks/verify_cost.py (same model, batch and patchset): it wraps the
verification phases (the original / patched / truth runs, the module checks) in
``record_function`` markers, runs ``engine.verify`` once under
``torch.profiler(profile_memory=True)`` and prints, for each phase, the running total when it
starts and its maximum, and the ops enclosing the overall peak. Slow (the per-phase sums are
quadratic in the number of allocations): a few minutes.

    PYTHONPATH=. PATCH_ENGINE_COMPILE=0 flock /tmp/heavy.lock python benchmarks/verify_peak.py [sample|all]
"""
import os, sys, functools
os.environ.setdefault("PATCH_ENGINE_COMPILE", "0")
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from pathlib import Path
import torch
from torch.profiler import profile, ProfilerActivity, record_function
import engine
import engine.verification.models as M
from verify_cost import load_gemma, real_batch

def marked(name, fn):
    @functools.wraps(fn)
    def w(*a, **k):
        with record_function("PHASE " + name):
            return fn(*a, **k)
    return w
M._truth_run = marked("truth", M._truth_run)
M._run = marked("run", M._run)
import engine.verification.runner as R
for n in ("compare_models", "verify_function", "verify_module", "capture_inputs"):
    setattr(R, n, marked(n, getattr(R, n)))
model, tok = load_gemma(Path("/tmp/verify_cost"))
model.train(); batch = real_batch(tok)
engine.apply(model, "gemma3_text", device="cpu", fused_cross_entropy=True)
model.zero_grad(set_to_none=True)
modules = sys.argv[1] if len(sys.argv) > 1 else "sample"
with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
    rep = engine.verify(model, batch=batch, modules=modules, raise_on_failure=False)
raw = list(prof.profiler.kineto_results.events())
mem = sorted((e.start_ns(), e.nbytes()) for e in raw if e.name() == "[memory]")
level = peak = 0; tpeak = 0
for t, n in mem:
    level += n
    if level > peak: peak, tpeak = level, t
MIB = 2**20
print("passed", rep.passed, "peak MiB", peak / MIB)
ops = [e for e in raw if e.name() != "[memory]" and e.start_ns() <= tpeak <= e.end_ns()]
for e in sorted(ops, key=lambda e: e.start_ns()):
    print("  at peak:", e.name(), e.shapes()[:3] if e.shapes() else "")
for e in sorted((e for e in raw if e.name().startswith("PHASE")), key=lambda e: e.start_ns()):
    lv = sum(n for t, n in mem if t < e.start_ns()); mx = 0; l = lv
    for t, n in mem:
        if e.start_ns() <= t <= e.end_ns():
            l += n; mx = max(mx, l)
    print(f"{e.name():40s} start {lv/MIB:8.0f} max {mx/MIB:8.0f}")
