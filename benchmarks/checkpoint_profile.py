"""Where the time goes on SmolLM2: training step, forward without gradients, decode; unpatched vs patched.

Why: ``patch-engine bench --checkpoint smollm2`` gives the ratios; this says which ops make
them (``torch.profiler``): per (work, variant), the ops with the most self CPU time, and the
total of the compiled regions (``CompiledFunction`` forward / backward, inductor kernels,
dynamo's guard checks). Variants: unpatched; patched as ``auto`` now runs it (the rule of
``engine/_data/compiled_rows.yaml``); and patched with every call of 16 rows or more compiled
(``compiled_from(16)``), which is how ``auto`` ran when ``benchmarks/results/cpu.md`` reported
the 384-token forward at "0.39x".

    flock /work/wt/heavy.lock python benchmarks/checkpoint_profile.py

Prints a table per (work, variant), with the load average, and writes
``benchmarks/results/checkpoint_profile_cpu.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PATCH_ENGINE_COMPILE", "1")

import torch
from torch.profiler import ProfilerActivity, profile

import engine
from engine.commands.bench_checkpoint import checkpoint_file, load
from engine.kernels import compiled

COMPILED_MARKS = ("CompiledFunction", "Torch-Compiled Region", "cpp_fused", "Guard", "inductor")


def _profile(fn: Any, top: int) -> dict[str, Any]:
    fn()  # warm-up (compiles)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    wall = time.perf_counter() - start
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    compiled_ms = sum(e.self_cpu_time_total for e in events if any(m in e.key for m in COMPILED_MARKS)) / 1e3
    return {"wall_ms": wall * 1e3, "total_ms": total / 1e3, "compiled_self_ms": compiled_ms,
            "load_average": os.getloadavg()[0],
            "top": [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3} for e in events[:top]]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train-seq", type=int, default=512)
    parser.add_argument("--forward-seq", type=int, default=384)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--works", nargs="+", default=["train", "forward", "decode"], choices=["train", "forward", "decode"])
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/checkpoint_profile_cpu.json"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load(gguf=checkpoint_file("smollm2"))
    gen = torch.Generator().manual_seed(0)
    train_ids = torch.randint(0, model.config.vocab_size, (1, args.train_seq), generator=gen)
    forward_ids = torch.randint(0, model.config.vocab_size, (1, args.forward_seq), generator=gen)

    def train() -> None:
        model.zero_grad(set_to_none=True)
        model(input_ids=train_ids, labels=train_ids).loss.backward()
        model.zero_grad(set_to_none=True)

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=forward_ids)

    def decode() -> None:
        with torch.no_grad():
            model.generate(input_ids=forward_ids[:, :1], max_new_tokens=8, min_new_tokens=8, do_sample=False)

    variants = (("unpatched", None, contextlib.nullcontext), ("patched (auto)", {}, contextlib.nullcontext),
                ("patched, compiled from 16 rows", {}, lambda: compiled.compiled_from(16)))
    results = {}
    works = {"train": ("train", train, "training"), "forward": (f"forward {args.forward_seq}", forward, "inference"),
             "decode": ("decode 8 tokens", decode, "inference")}
    for work, fn, mode in (works[w] for w in args.works):
        for variant, settings, context in variants:
            model.train(mode == "training")
            if settings is not None:
                engine.apply(model, "llama", device="cpu", mode=mode, **settings)
            try:
                with context():
                    results[f"{work} | {variant}"] = r = _profile(fn, args.top)
            finally:
                if settings is not None:
                    engine.revert(model)
            print(f"\n== {work} | {variant}: wall {r['wall_ms']:.0f} ms, {r['total_ms']:.0f} ms self CPU in all, "
                  f"compiled regions {r['compiled_self_ms']:.0f} ms (load average {r['load_average']:.1f})")
            for t in r["top"]:
                print(f"  {t['self_ms']:9.1f} ms  {t['calls']:5d}x  {t['op'][:90]}")
    args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
