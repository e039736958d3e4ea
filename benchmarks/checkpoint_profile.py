"""Where the time goes in a SmolLM2 training step and a decode step, unpatched vs patched (torch.profiler).

Why: ``patch-engine bench --checkpoint smollm2`` and ``benchmarks/generate_speed.py`` give the
ratios; this says which ops make them: per variant, the ops with the most self CPU time, and
the total of the compiled regions (``CompiledFunction`` forward / backward, inductor kernels).

    flock /tmp/heavy.lock python benchmarks/checkpoint_profile.py

Prints a table per (work, variant) and writes ``benchmarks/results/checkpoint_profile_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

os.environ.setdefault("PATCH_ENGINE_COMPILE", "1")

import torch
from torch.profiler import ProfilerActivity, profile

import engine
from engine.bench_checkpoint import checkpoint_file, load


def _profile(fn: Any, top: int) -> dict[str, Any]:
    fn()  # warm-up (compiles)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return {"total_ms": total / 1e3,
            "top": [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3} for e in events[:top]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/checkpoint_profile_cpu.json"))
    args = parser.parse_args(argv)
    model = load(gguf=checkpoint_file("smollm2")).train()
    ids = torch.randint(0, model.config.vocab_size, (1, args.seq), generator=torch.Generator().manual_seed(0))

    def train() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()

    def decode() -> None:
        with torch.no_grad():
            model.generate(input_ids=ids[:, :16], max_new_tokens=8, min_new_tokens=8, do_sample=False)

    results = {}
    for variant, settings in (("unpatched", None), ("patched", {}), ("patched + fused head", {"fused_cross_entropy": True})):
        if settings is not None:
            engine.apply(model, "llama", device="cpu", mode="training", **settings)
        for work, fn in (("train", train), ("decode 8 tokens", decode)):
            if work != "train" and variant == "patched + fused head":
                continue
            results[f"{work} | {variant}"] = r = _profile(fn, args.top)
            print(f"\n== {work} | {variant}: {r['total_ms']:.0f} ms self CPU in all")
            for t in r["top"]:
                print(f"  {t['self_ms']:9.1f} ms  {t['calls']:5d}x  {t['op'][:90]}")
        if settings is not None:
            engine.revert(model)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
