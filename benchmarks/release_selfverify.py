"""What self-verification on an unverified transformers release costs ``engine.apply``: first, cached, in range.

Issue 31's goal: the first apply of a patchset on a release outside its ``requires`` (which
verifies it on the tiny model of its type first) within 10 s for qwen3 on this CPU, and an apply
whose verdict is cached within 50 ms of an apply inside the range.

Each patchset runs in two fresh processes (imports done before timing: a user has a model by then),
on the tiny model of its family as the user's model, with an empty cache folder of its own:

1. ``first``: the bundled patchset as it is (in range) applied and reverted once (lazy imports
   and kernel builds, which any first apply pays), then the same content with ``requires`` ending
   just below the installed release (the day 5.25.0 came out): the first apply, which
   self-verifies (``first_s``); then, alternating, 5 in-range and 5 cached applies (each reverted),
   medians ``in_range_ms`` and ``cached_ms``.
2. ``cold``: a new process reading the verdict the first wrote: its *first* apply is the cached
   one (``cold_cached_ms``), against a process whose first apply is in range (``cold_in_range_ms``);
   three of each, alternating, medians.

    PYTHONPATH=. python benchmarks/release_selfverify.py qwen3 qwen3_moe SLOWEST \\
        --out benchmarks/results/release_selfverify.json
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


def _child(name: str, phase: str) -> dict[str, Any]:
    """Run in a subprocess: the timings of one phase for one patchset."""
    import warnings

    import transformers

    import engine
    from engine.loader import load_patchset
    from engine.tiny import build_tiny_model

    warnings.simplefilter("ignore")
    inside = load_patchset(name)
    outside = inside.model_dump(mode="json", exclude_none=True)
    outside["requires"] = {"transformers": f"<{transformers.__version__}"}
    tiny = inside.tiny_model
    model_type = (tiny.model_type if tiny and tiny.model_type else None) or inside.model_types[0]
    model = build_tiny_model(model_type, dict(tiny.config) if tiny else {},
                             random_buffers=tiny.random_buffers if tiny else None)
    model.train()

    def timed(patchset: Any) -> tuple[float, Any]:
        start = time.perf_counter()
        report = engine.apply(model, patchset, device="cpu")
        seconds = time.perf_counter() - start
        engine.revert(model)
        return seconds, report

    if phase == "cold_in_range":
        return {"cold_in_range_ms": timed(name)[0] * 1e3}
    if phase == "cold_cached":
        seconds, report = timed(outside)
        assert report.release.cached, "the verdict was not read from the cache"
        return {"cold_cached_ms": seconds * 1e3}
    timed(name)  # warm-up: what any first apply pays
    first, report = timed(outside)
    assert report.release.passed and not report.release.cached, report.release
    inside_ms, cached_ms = [], []
    for _ in range(5):
        inside_ms.append(timed(name)[0] * 1e3)
        cached_ms.append(timed(outside)[0] * 1e3)
    return {"first_s": first, "self_verification_s": report.release.seconds, "checks": report.release.checks,
            "in_range_ms": statistics.median(inside_ms), "cached_ms": statistics.median(cached_ms),
            "patched": len(report.patched)}


def measure(name: str, repeats: int = 3) -> dict[str, Any]:
    """One patchset: the ``first`` process, then ``repeats`` new processes of each cold phase (their medians).

    Cold means cold: each process gets empty inductor and Triton caches of its own (a first run on a
    machine compiles), and the verdict cache starts empty for ``first``.
    """
    row: dict[str, Any] = {"patchset": name}
    cold: dict[str, list[float]] = {"cold_in_range_ms": [], "cold_cached_ms": []}
    with tempfile.TemporaryDirectory() as cache:
        def child(phase: str) -> dict[str, Any]:
            with tempfile.TemporaryDirectory() as compiler:
                env = {**os.environ, "PATCH_ENGINE_CACHE_DIR": cache, "PYTHONPATH": str(ROOT),
                       "TORCHINDUCTOR_CACHE_DIR": f"{compiler}/inductor", "TRITON_CACHE_DIR": f"{compiler}/triton"}
                done = subprocess.run([sys.executable, __file__, "--child", name, phase], capture_output=True,
                                      text=True, env=env, check=True)
            return json.loads(done.stdout.strip().splitlines()[-1])

        row.update(child("first"))
        for _ in range(repeats):
            for phase in ("cold_in_range", "cold_cached"):
                for key, value in child(phase).items():
                    cold[key].append(value)
    row.update({key: statistics.median(values) for key, values in cold.items()})
    row["cached_minus_in_range_ms"] = row["cached_ms"] - row["in_range_ms"]
    row["cold_cached_minus_in_range_ms"] = row["cold_cached_ms"] - row["cold_in_range_ms"]
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", default=["qwen3", "qwen3_moe"])
    parser.add_argument("--out", help="JSON file to write")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(*args.child)))
        return 0
    import torch
    import transformers

    rows = []
    for name in args.names:
        row = measure(name)
        rows.append(row)
        print(f"{name}: first apply {row['first_s']:.2f} s (self-verification {row['self_verification_s']} s, "
              f"{row['checks']} checks); cached {row['cached_ms']:.1f} ms vs in range {row['in_range_ms']:.1f} ms "
              f"(+{row['cached_minus_in_range_ms']:.1f} ms); in a new process {row['cold_cached_ms']:.1f} vs "
              f"{row['cold_in_range_ms']:.1f} ms (+{row['cold_cached_minus_in_range_ms']:.1f} ms)", flush=True)
    result = {"transformers": transformers.__version__, "torch": torch.__version__, "machine": platform.machine(),
              "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "rows": rows,
              "command": "PYTHONPATH=. python benchmarks/release_selfverify.py " + " ".join(args.names)}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
