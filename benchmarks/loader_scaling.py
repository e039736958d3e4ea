"""Time to load generated patchsets of 1k, 5k and 10k patches: is loading linear?

Usage: ``python benchmarks/loader_scaling.py [--sizes 1000 5000 10000] [--runs 3] [--root CHECKOUT]``
(default: this checkout; ``--root`` measures another one, e.g. the tree before a change, with the
same files and the same command).

Three shapes, each generated into a temporary folder:

- ``plain``: one file, one four-key patch per target (the shape of a bundled patchset, scaled up);
- ``extends``: a child of the same size that ``extends`` a base of the same size and replaces
  every other base patch (the merge that moves every line origin);
- ``errors``: every patch has a wrong ``kernel`` value, so every patch yields an error message.

Each size runs in a fresh interpreter (the loader imported, a first small load done, then the
timed load; median of ``--runs``), and the line prints seconds and microseconds per patch: a
linear loader keeps the per-patch cost flat as the size grows; a quadratic one multiplies it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_PROBE = """
import json, sys, time
from engine.errors import PatchsetError
from engine.loader import load_patchset
load_patchset({"name": "warm", "model_types": ["qwen3"], "patches": []})
start = time.perf_counter()
try:
    patchset = load_patchset(sys.argv[1])
    outcome = f"{len(patchset.patches)} patches"
except PatchsetError as exc:
    outcome = f"{len(getattr(exc, 'errors', None) or [exc])} errors"
print(json.dumps({"seconds": time.perf_counter() - start, "outcome": outcome}))
"""


def _patches(n: int, *, scale: str = "weight", kernel: str | None = None, every: int = 1) -> list[str]:
    lines = []
    for i in range(0, n * every, every):
        lines += [f"  - target: Norm{i:06d}", "    op: rms_norm", f"    scale: {scale}"]
        lines.append("    eps_attr: variance_epsilon")
        if kernel is not None:
            lines.append(f"    kernel: {kernel}")
    return lines


def write_shape(folder: Path, shape: str, n: int) -> Path:
    """Write the patchset of ``shape`` with ``n`` patches (and its base) into ``folder``; return the file to load."""
    head = ["name: big", "model_types: [qwen3]", "patches:"]
    path = folder / f"{shape}_{n}.yaml"
    if shape == "plain":
        body = head + _patches(n)
    elif shape == "errors":
        body = head + _patches(n, kernel="[1]")
    elif shape == "extends":
        base = folder / f"base_{n}.yaml"
        base.write_text("\n".join(head + _patches(n)) + "\n", encoding="utf-8")
        body = ["name: child", f"extends: {base.name}", "patches:"] + _patches(n, scale="one_plus_weight", every=2)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    path.write_text("\n".join(body) + "\n", encoding="utf-8")
    return path


def _time_once(root: Path, path: Path) -> tuple[float, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", _PROBE, str(path)], cwd=root, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(done.stderr)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["seconds"], result["outcome"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 5000, 10000])
    parser.add_argument("--shapes", nargs="+", default=["plain", "extends", "errors"])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    print(f"{root} ({os.cpu_count()} CPUs, Python {sys.version.split()[0]}), median of {args.runs} fresh interpreters")
    print(f"{'shape':8} {'patches':>8} {'KB':>6} {'seconds':>8} {'us/patch':>9}  outcome")
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            for n in args.sizes:
                path = write_shape(Path(tmp), shape, n)
                runs = [_time_once(root, path) for _ in range(args.runs)]
                seconds = statistics.median(t for t, _ in runs)
                size_kb = path.stat().st_size / 1024
                print(f"{shape:8} {n:8d} {size_kb:6.0f} {seconds:8.3f} {seconds / n * 1e6:9.1f}  {runs[0][1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
