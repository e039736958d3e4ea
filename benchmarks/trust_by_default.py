"""What "nothing unverified patches by default" costs ``engine.apply``: a user's file first, from the cache, bundled.

Issue 38's goals, on this CPU: a user's own file (inside its range: content CI never verified)
first applied within 3 s on qwen3 (it is verified first, on a tiny model of the user's type), then
within 50 ms from the cached verdict; bundled content on a tested release costs nothing extra (the
gate reads the shipped manifest: a hash of the content, no tiny model).

Each patchset runs in fresh processes (imports done before timing: a user has a model by then),
on the tiny model of its family as the user's model, with an empty verdict cache of its own:

1. ``first``: the bundled patchset applied and reverted once (lazy imports and kernel builds, which
   any first apply pays); then the user's file (a copy of the bundled YAML under another name, in
   its range): its first apply, which verifies it (``first_s``); then, alternating, 5 applies each
   (reverted) of: the bundled name through the gate (``bundled_ms``), the same plan with no gate at
   all (:func:`engine.patching.patcher.apply`: what apply cost before issue 38, ``ungated_ms``), and
   the user's file from the cache (``cached_ms``); medians (and minimums, ``*_min_ms``).
2. ``cold``: new processes whose *first* apply is each of those (the cached one reads the verdict the
   first process wrote; the engine fingerprint of the verdict's key is computed then); three each,
   alternating, medians.

    PYTHONPATH=. python benchmarks/trust_by_default.py qwen3 qwen3_moe --out benchmarks/results/trust_by_default.json
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
#: Applies of each kind in the first process (alternating); medians and minimums (a loaded machine adds noise
#: to every apply, so the minimum is the better estimate of what one costs).
REPEATS = 15


def _child(name: str, phase: str, folder: str) -> dict[str, Any]:
    """Run in a subprocess: the timings of one phase for one patchset."""
    import warnings

    import engine
    from engine.loader import load_patchset
    from engine.patching.patcher import apply as ungated
    from engine.tiny import build_tiny_model

    warnings.simplefilter("ignore")
    bundled = load_patchset(name)
    user = Path(folder) / f"my_{name}.yaml"  # a user's file: the bundled YAML under another name
    if not user.exists():
        text = (ROOT / "patchsets" / f"{name}.yaml").read_text(encoding="utf-8")
        user.write_text(text.replace(f"name: {name}\n", f"name: my_{name}\n", 1), encoding="utf-8")
    tiny = bundled.tiny_model
    model_type = (tiny.model_type if tiny and tiny.model_type else None) or bundled.model_types[0]
    model = build_tiny_model(model_type, dict(tiny.config) if tiny else {},
                             random_buffers=tiny.random_buffers if tiny else None)
    model.train()

    def timed(how: str) -> tuple[float, Any]:
        start = time.perf_counter()
        if how == "ungated":
            report = ungated(model, name, device="cpu")
        else:
            report = engine.apply(model, name if how == "bundled" else user, device="cpu")
        seconds = time.perf_counter() - start
        engine.revert(model)
        return seconds, report

    if phase.startswith("cold_"):
        seconds, report = timed(phase.removeprefix("cold_"))
        if phase == "cold_cached" and not report.release.cached:  # the engine's code changed meanwhile (its
            return {}  # fingerprint is in the key: a checkout being edited); not a sample of a cached apply
        return {f"{phase}_ms": seconds * 1e3}
    timed("bundled")  # warm-up: what any first apply pays
    first, report = timed("user")
    verdict = report.release
    assert verdict.passed and not verdict.cached, verdict
    times: dict[str, list[float]] = {"bundled": [], "ungated": [], "cached": []}
    for _ in range(REPEATS):
        for how in times:
            seconds, report = timed("user" if how == "cached" else how)
            assert how != "cached" or report.release.cached
            assert how != "bundled" or report.release is None  # known verified: no verdict, no warning
            times[how].append(seconds * 1e3)
    return {"first_s": first, "self_verification_s": verdict.seconds, "checks": verdict.checks,
            "verified_on": verdict.model, **{f"{k}_ms": statistics.median(v) for k, v in times.items()},
            **{f"{k}_min_ms": min(v) for k, v in times.items()}, "patched": len(report.patched)}


def measure(name: str, repeats: int = 3) -> dict[str, Any]:
    """One patchset: the ``first`` process, then ``repeats`` new processes of each cold phase (their medians)."""
    row: dict[str, Any] = {"patchset": name}
    cold: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        cache = Path(folder) / "cache"

        def child(phase: str) -> dict[str, Any]:
            with tempfile.TemporaryDirectory() as compiler:
                env = {**os.environ, "PATCH_ENGINE_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT),
                       "TORCHINDUCTOR_CACHE_DIR": f"{compiler}/inductor", "TRITON_CACHE_DIR": f"{compiler}/triton"}
                env.pop("PATCH_ENGINE_UNVERIFIED", None)
                env.pop("PATCH_ENGINE_UNVERIFIED_RELEASE", None)
                done = subprocess.run([sys.executable, __file__, "--child", name, phase, folder], capture_output=True,
                                      text=True, env=env, check=True)
            return json.loads(done.stdout.strip().splitlines()[-1])

        row.update(child("first"))
        for _ in range(repeats):
            for phase in ("cold_bundled", "cold_ungated", "cold_cached"):
                for key, value in child(phase).items():
                    cold.setdefault(key, []).append(value)
    row.update({key: statistics.median(values) for key, values in cold.items()})
    row["cold_cached_samples"] = len(cold.get("cold_cached_ms", []))
    row.setdefault("cold_cached_ms", float("nan"))
    return row


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Nothing unverified patches by default: what it costs `engine.apply`",
        "",
        f"`{result['command']}` on {result['machine']}, {result['cpus']} CPUs ({result['threads']} torch threads), "
        f"transformers {result['transformers']}, torch {result['torch']}; load average when it started: "
        f"{result['load']}. Tiny model of each family as the user's model, fp32, training, CPU; medians. "
        "*user first*: a copy of the bundled YAML under another name (content CI never verified, inside its "
        "range), first applied: verified first on a tiny model of the user's type. *cached*: the same file "
        "applied again, its verdict read from the cache. *bundled*: the bundled name through the gate (the "
        "manifest says CI verified it on this release). *ungated*: the same plan patched with no gate at all "
        "(what apply did before issue 38). *new process*: that apply is the process's first.",
        "",
        "| patchset | user first | its self-verification | checks | cached (min) | bundled (min) | ungated (min) "
        "| new process: cached | bundled | ungated |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['patchset']} | {r['first_s']:.2f} s | {r['self_verification_s']} s ({r['verified_on']}) | "
            f"{r['checks']} | {r['cached_ms']:.1f} ({r['cached_min_ms']:.1f}) ms | {r['bundled_ms']:.1f} "
            f"({r['bundled_min_ms']:.1f}) ms | {r['ungated_ms']:.1f} ({r['ungated_min_ms']:.1f}) ms | "
            f"{r['cold_cached_ms']:.0f} ms | {r['cold_bundled_ms']:.0f} ms | {r['cold_ungated_ms']:.0f} ms |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", default=["qwen3", "qwen3_moe"])
    parser.add_argument("--out", help="JSON file to write (and a .md beside it)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*args.child)))
        return 0
    import torch
    import transformers

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    rows = []
    for name in args.names:
        row = measure(name)
        rows.append(row)
        print(f"{name}: user file first {row['first_s']:.2f} s (self-verification {row['self_verification_s']} s, "
              f"{row['checks']} checks); cached {row['cached_ms']:.1f} ms; bundled {row['bundled_ms']:.1f} ms vs "
              f"ungated {row['ungated_ms']:.1f} ms; new process: cached {row['cold_cached_ms']:.1f}, bundled "
              f"{row['cold_bundled_ms']:.1f}, ungated {row['cold_ungated_ms']:.1f} ms", flush=True)
    result = {"transformers": transformers.__version__, "torch": torch.__version__, "machine": platform.machine(),
              "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "load": load, "rows": rows,
              "command": "PYTHONPATH=. python benchmarks/trust_by_default.py " + " ".join(args.names)}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
        Path(args.out).with_suffix(".md").write_text(_markdown(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
