"""What the default ``engine.apply`` costs: cold and warm, peak extra memory, the real-module check on and off.

Issue 45 item 4 sets the budget: on SmolLM2-135M and Gemma 3 270M on this CPU, the default apply stays
under 1.5 s cold (the first apply in a process) and 50 ms warm (a second model of the same kind in the
same process), with at most 10% of the model's memory extra; the same reported for a randomly
initialised Qwen3-0.6B-sized model. "Default" is both ``engine.apply(model)`` (zero configuration)
and ``engine.apply(model, name)`` (the bundled patchset named), each with the real-module check on
(``check_modules=True``, the default: after) and off (before).

How each number is taken, in a fresh process per (model, patchset, check) and repeat:

* the model is loaded from a ``save_pretrained`` folder the first step wrote (a .gguf de-quantized to
  fp32 once, or the random Qwen3 built once with a fixed seed), put in training mode (the check then
  runs the backward too); its twin is a second model object of the same classes that shares the
  first's parameter tensors (``deepcopy`` with the parameters memoized): a second model for every
  cache keyed by object, no second copy of the weights in this 24 GiB machine shared by six jobs;
* ``cold``: the first ``apply`` in the process (``engine.api``, which ``engine.apply`` imports on first
  use, imported before and timed apart as ``import_s``; the disk verdict caches primed by a first
  process, as a user's second run finds them); ``warm``: ``apply`` on the twin right after;
* peak extra memory: the process's resident-set high-water mark during the call minus its resident
  set just before (``/proc/self/clear_refs`` resets the mark; ``malloc_trim`` first returns freed
  heap to the system, so reused free lists do not hide an allocation). Not ``torch.profiler``'s CPU
  memory: it counts frees of tensors allocated before the call as negative.

``--threads 1`` runs each process on one torch thread. Why: this 2-core machine is shared by six
jobs (load average 8-10), and torch's two OpenMP threads then wait on each other at every op's
barrier: a 64 x 128 linear layer took 9-23 ms with two threads and 0.05-0.9 ms with one, in the same
minute. One thread measures the work; the default measures that machine's contention too.

    PYTHONPATH=. python benchmarks/apply_default.py --threads 1 --out benchmarks/results/apply_default.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"smollm2": "llama", "gemma3": "gemma3_text", "qwen3_0_6b": "qwen3"}
QWEN3_0_6B = {"hidden_size": 1024, "num_hidden_layers": 28, "intermediate_size": 3072, "num_attention_heads": 16,
              "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": True,
              "max_position_embeddings": 40960, "rms_norm_eps": 1e-6}


def _prepare(name: str, folder: str, dtype_name: str) -> dict[str, Any]:
    """Child: write the model as a ``save_pretrained`` folder (the children load that, in seconds)."""
    import torch

    dtype = getattr(torch, dtype_name)
    if name == "qwen3_0_6b":
        from transformers import Qwen3Config, Qwen3ForCausalLM

        torch.manual_seed(0)
        config = Qwen3Config(**QWEN3_0_6B)
        model = Qwen3ForCausalLM._from_config(config, dtype=dtype)
    else:
        from engine.commands.checkpoints import checkpoint_file, load_checkpoint

        model, _ = load_checkpoint(gguf=checkpoint_file(name), dtype=dtype, tokenizer=False)
    model.save_pretrained(folder)
    return {"parameters": sum(p.numel() for p in model.parameters())}


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _measured(call: Any) -> tuple[float, int, Any]:
    """``(seconds, peak extra bytes, result)`` of ``call()`` (see the module docstring)."""
    import ctypes
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark := the resident set now
    start = time.perf_counter()
    result = call()
    seconds = time.perf_counter() - start
    return seconds, max(_status("VmHWM") - before, 0), result


def _child(name: str, folder: str, patchset: str, check: str, dtype_name: str, threads: str) -> dict[str, Any]:
    """Child: cold apply on the model, then warm apply on its twin; times, peaks and what the check did."""
    import copy
    import warnings

    import torch

    if int(threads):
        torch.set_num_threads(int(threads))
    from transformers import AutoModelForCausalLM

    import engine

    warnings.simplefilter("ignore")
    started = time.perf_counter()
    import engine.api  # noqa: F401 - what `engine.apply` imports on first use; timed apart (import_s)

    imported = time.perf_counter() - started
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype_name))
    model.train()
    shared = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    twin = copy.deepcopy(model, shared)  # same classes and weights, another model object
    named = None if patchset == "zero" else MODELS[name]
    on = check == "on"
    row: dict[str, Any] = {"model": name, "patchset": patchset, "check": check, "threads": torch.get_num_threads(),
                           "import_s": imported}
    row["model_mb"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    for label, target in (("cold", model), ("warm", twin)):
        seconds, peak, report = _measured(lambda m=target: engine.apply(m, named, check_modules=on))
        row[f"{label}_s"], row[f"{label}_peak_mb"] = seconds, peak / 2**20
        found = report.real_modules
        row[f"{label}_check_s"] = found.seconds if on else 0.0
        if label == "cold":
            row["patched"] = len(report.patched)
            row["real_modules"] = found.summary()
            row["checked"] = [f"{m.cls} ({m.op}) w{m.width}: {m.seconds:.3f} s" for m in found.checked]
            row["passed"] = found.passed
    return row


def _run(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, __file__, "--child", *args], env=env, capture_output=True, text=True,
                         check=False)
    if out.returncode:
        raise RuntimeError(f"{args} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(name: str, repeats: int, dtype_name: str, work: Path, threads: int) -> list[dict[str, Any]]:
    load_start = [round(x, 1) for x in os.getloadavg()]
    folder = work / name
    cache = work / f"cache-{name}"
    env = {**os.environ, "PATCH_ENGINE_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    info = _run(["prepare", name, str(folder), dtype_name], env)
    t = str(threads)
    primed = _run(["child", name, str(folder), "zero", "on", dtype_name, t], env)  # first ever: fills the disk caches
    _run(["child", name, str(folder), "named", "on", dtype_name, t], env)
    rows = []
    for _ in range(repeats):
        for patchset in ("zero", "named"):
            for check in ("off", "on"):  # alternating: drift in the machine's load hits both alike
                rows.append(_run(["child", name, str(folder), patchset, check, dtype_name, t], env))
    summary = []
    for patchset in ("zero", "named"):
        for check in ("off", "on"):
            mine = [r for r in rows if r["patchset"] == patchset and r["check"] == check]
            row = {k: mine[0][k] for k in ("model", "patchset", "check", "threads", "model_mb", "patched",
                                            "real_modules", "checked", "passed")}
            for key in ("import_s", "cold_s", "warm_s", "cold_peak_mb", "warm_peak_mb", "cold_check_s", "warm_check_s"):
                row[key] = statistics.median(r[key] for r in mine)
                row[key + "_all"] = [round(r[key], 4) for r in mine]
            row.update(dtype=dtype_name, parameters=info["parameters"], first_ever_cold_s=primed["cold_s"],
                       repeats=repeats, load=[load_start, [round(x, 1) for x in os.getloadavg()]])
            summary.append(row)
    return summary


def _markdown(rows: list[dict[str, Any]], env: dict[str, Any]) -> str:
    lines = [
        "# The default `engine.apply`: cold, warm and peak extra memory, real-module check off / on",
        "",
        "Budget (issue 45): under 1.5 s cold and 50 ms warm, at most 10% of the model's parameter memory extra.",
        "Cold: the first apply in a process (disk verdict caches primed); warm: a second model object of the same",
        "kind in that process. Training mode (the check compares the backward too). Medians of "
        "several processes each (`repeats`); every run in the JSON (benchmarks/apply_default.py).",
        "",
        "| model (dtype, MiB, threads) | apply | check | import (s) | cold (s) | of it, check (s) | warm (ms) "
        "| of it, check (ms) | peak extra cold (MiB, % of model) | peak extra warm (MiB) | what the check did |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        share = 100 * r["cold_peak_mb"] / r["model_mb"]
        call = "apply(model)" if r["patchset"] == "zero" else f"apply(model, {MODELS[r['model']]!r})"
        lines.append(
            f"| {r['model']} ({r['dtype']}, {r['model_mb']:.0f}, {r['threads']}) | {call} | {r['check']} | "
            f"{r['import_s']:.2f} | {r['cold_s']:.2f} | {r['cold_check_s']:.2f} | {1e3 * r['warm_s']:.1f} | "
            f"{1e3 * r['warm_check_s']:.1f} | {r['cold_peak_mb']:.1f} ({share:.1f}%) | "
            f"{r['warm_peak_mb']:.1f} | {r['real_modules'] if r['check'] == 'on' else '-'} |")
    lines += ["", "Per class, the first (cold) check of each model (apply(model, name), check on):", ""]
    for r in rows:
        if r["check"] == "on" and r["patchset"] == "named":
            lines.append(f"- {r['model']} ({r['threads']} thread(s)): " + "; ".join(r["checked"]))
    lines += ["", f"Environment: {env['platform']}, {env['cpus']} cores shared with other jobs ({env['date']}); "
              "load averages (1, 5, 15 min) at the start and the end of each model's runs: "
              + "; ".join(f"{r['model']} ({r['threads']} thread(s)) {r['load'][0]} to {r['load'][1]}" for r in rows
                          if r["check"] == "on"
                          and r["patchset"] == "named") + ".", "", f"Command: `{env['command']}`", ""]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        what, rest = sys.argv[2], sys.argv[3:]
        print(json.dumps(_prepare(*rest) if what == "prepare" else _child(*rest)))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16 (every model)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads in each process (0: torch's default)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/apply_default.json")
    args = parser.parse_args()
    env = {"platform": platform.platform(), "cpus": os.cpu_count(), "repeats": args.repeats,
           "load_start": [round(x, 1) for x in os.getloadavg()], "date": time.strftime("%Y-%m-%d %H:%M"),
           "command": "PYTHONPATH=. python benchmarks/apply_default.py " + " ".join(sys.argv[1:])}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="apply-default-") as work:
        for name in args.models:
            rows += measure(name, args.repeats, args.dtype, Path(work), args.threads)
            print(json.dumps(rows[-4:], indent=1), flush=True)
    env["load_end"] = [round(x, 1) for x in os.getloadavg()]
    existing = json.loads(args.out.read_text()) if args.out.exists() else {"rows": []}
    done = {(m, args.threads) for m in args.models}
    kept = [r for r in existing.get("rows", []) if (r["model"], r.get("threads_asked", 0)) not in done]
    for r in rows:
        r["threads_asked"] = args.threads
    data = {"environment": env, "rows": kept + rows}
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(_markdown(data["rows"], env))


if __name__ == "__main__":
    main()
