"""What zero configuration costs ``engine.apply(model)``: the first apply (measure + verify), then cached.

Issue 41: ``engine.apply(model)`` with no patchset measures declarations on a tiny copy of the
model (the scaffold), verifies them there and caches both, so a training script measures once per
release. ``"measure"`` forces the measured path on a type that has a bundled patchset, so the
same family can be compared with its bundled (named) patchset.

Each model type runs in fresh processes (imports done before timing), on the tiny model of its
family as the user's model (fp32, training mode, CPU), with an empty cache folder of its own:

1. ``first``: the bundled patchset named, applied and reverted once (lazy imports and first-call
   costs any apply pays), then ``apply(model, "measure")`` (``first_s``: measurement
   ``measure_s`` + verification ``verify_s`` + planning and patching); then, alternating, 5
   measured applies (both read from the cache) and 5 applies of the bundled patchset named,
   medians ``cached_ms`` and ``named_ms``.
2. ``cold``: a new process whose first apply is the measured one, read from the cache the first
   wrote (``cold_cached_ms``), against a new process whose first apply names the bundled
   patchset (``cold_named_ms``); three of each, alternating, medians.

    PYTHONPATH=. python benchmarks/zero_config.py qwen3 qwen3_moe --out benchmarks/results/zero_config.json
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


def _child(model_type: str, phase: str) -> dict[str, Any]:
    """Run in a subprocess: the timings of one phase for one model type."""
    import warnings

    import engine
    from engine.tiny import build_tiny_model

    warnings.simplefilter("ignore")
    model = build_tiny_model(model_type)
    model.train()

    def timed(patchset: Any) -> tuple[float, Any]:
        start = time.perf_counter()
        report = engine.apply(model, patchset, device="cpu")
        seconds = time.perf_counter() - start
        engine.revert(model)
        return seconds, report

    if phase == "cold_named":
        return {"cold_named_ms": timed(model_type)[0] * 1e3}
    if phase == "cold_cached":
        seconds, report = timed("measure")
        zc = report.zero_config
        assert zc.measure_cached and zc.verdict["cached"], "not read from the cache"
        return {"cold_cached_ms": seconds * 1e3}
    timed(model_type)  # warm-up: what any first apply pays
    first, report = timed("measure")
    zc = report.zero_config
    assert zc.patched and not zc.measure_cached and not zc.verdict["cached"], zc
    cached_ms, named_ms = [], []
    for _ in range(5):
        cached_ms.append(timed("measure")[0] * 1e3)
        named_ms.append(timed(model_type)[0] * 1e3)
    return {"first_s": first, "measure_s": zc.measure_seconds, "verify_s": zc.verdict["seconds"],
            "checks": zc.verdict["checks"], "measured": len(zc.measured), "patched": len(zc.patched),
            "modules_patched": len(report.patched), "failed": len(zc.failed),
            "cached_ms": statistics.median(cached_ms), "named_ms": statistics.median(named_ms)}


def _run(model_type: str, phase: str, cache: str) -> dict[str, Any]:
    env = {**os.environ, "PATCH_ENGINE_CACHE_DIR": cache, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, __file__, "--child", model_type, phase], env=env, capture_output=True,
                         text=True, check=False)
    if out.returncode:
        raise RuntimeError(f"{model_type} {phase} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_type(model_type: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="zero-config-bench-") as cache:
        os.chmod(cache, 0o700)
        row: dict[str, Any] = {"model_type": model_type, **_run(model_type, "first", cache)}
        cold: dict[str, list[float]] = {"cold_cached_ms": [], "cold_named_ms": []}
        for _ in range(3):
            for phase in ("cold_cached", "cold_named"):
                cold[f"{phase}_ms"].append(_run(model_type, phase, cache)[f"{phase}_ms"])
        row.update({k: statistics.median(v) for k, v in cold.items()})
    return row


def _markdown(rows: list[dict[str, Any]], env: dict[str, Any]) -> str:
    lines = [
        "# Zero configuration: what `engine.apply(model)` with no patchset costs",
        "",
        "`apply(model, \"measure\")` (the measured path, forced on a type with a bundled patchset so the two compare):",
        "the scaffold's measurement on a tiny copy of the model's own config and classes, its verification there, both",
        "cached; against an apply of the bundled patchset named. fp32, training mode, CPU; the tiny model of the type",
        "stands for the user's model (benchmarks/zero_config.py).",
        "",
        "| model type | first apply (s) | measure (s) | verify (s) | checks | declarations (patched) | cached (ms) "
        "| named (ms) | new process: cached / named (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['model_type']} | {r['first_s']:.2f} | {r['measure_s']:.2f} | {r['verify_s']:.2f} | "
                     f"{r['checks']} | {r['measured']} ({r['patched']}) | {r['cached_ms']:.1f} | {r['named_ms']:.1f} | "
                     f"{r['cold_cached_ms']:.0f} / {r['cold_named_ms']:.0f} |")
    lines += ["", f"Environment: {env['platform']}, {env['cpus']} cores, load average {env['load_start']} when it "
              f"started and {env['load_end']} when it ended ({env['date']}; other jobs shared the machine).", "",
              f"Command: `{env['command']}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_types", nargs="*", default=["qwen3", "qwen3_moe"])
    parser.add_argument("--out", help="write the JSON here (and the Markdown beside it)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*args.child)))
        return 0
    load_start = os.getloadavg()[0]
    rows = []
    for model_type in args.model_types:
        rows.append(measure_type(model_type))
        print(json.dumps(rows[-1]), flush=True)
    import torch
    import transformers

    env = {"platform": f"transformers {transformers.__version__}, torch {torch.__version__}, {platform.machine()}",
           "cpus": os.cpu_count(), "load_start": round(load_start, 1), "load_end": round(os.getloadavg()[0], 1),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": "PYTHONPATH=. python benchmarks/zero_config.py " + " ".join(args.model_types)
           + (f" --out {args.out}" if args.out else "")}
    if args.out:
        Path(args.out).write_text(json.dumps({"rows": rows, "environment": env}, indent=2) + "\n")
        Path(args.out).with_suffix(".md").write_text(_markdown(rows, env))
    else:
        print(_markdown(rows, env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
