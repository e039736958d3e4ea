"""Wall time of ``python -m engine validate patchsets/*.yaml``, each run in a fresh interpreter.

Usage: ``python benchmarks/validate_time.py [--runs 5] [--root CHECKOUT]`` (default: this checkout;
``--root`` measures another one, e.g. the tree before a change, with the same command).

Why a fresh subprocess each time: what a pre-commit hook or a CI schema job pays is the
interpreter start plus every import the command triggers (torch alone is seconds), not the
validation itself. Prints every run, the median, and which heavy modules the command imported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Imported by validate only if the layering is broken (see docs/architecture.md).
HEAVY = ("torch", "transformers")

_PROBE = (
    "import runpy, sys\n"
    "sys.argv = ['engine', 'validate', '--quiet', *sys.argv[1:]]\n"
    "try:\n"
    "    runpy.run_module('engine', run_name='__main__', alter_sys=True)\n"
    "except SystemExit as exc:\n"
    "    code = exc.code\n"
    "else:\n"
    "    code = 0\n"
    f"print('heavy imported:', [m for m in {HEAVY!r} if m in sys.modules] or 'none', file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure")
    args = parser.parse_args(argv)
    root = args.root.resolve()
    files = sorted(str(p) for p in (root / "patchsets").glob("*.yaml"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "engine", "validate", "--quiet", *files]
    times = []
    for run in range(args.runs):
        start = time.perf_counter()
        done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
        times.append(time.perf_counter() - start)
        if done.returncode != 0:
            print(done.stdout, done.stderr, sep="\n", file=sys.stderr)
            return done.returncode
        print(f"run {run + 1}: {times[-1]:.2f} s")
    probe = subprocess.run([sys.executable, "-c", _PROBE, *files], cwd=root, env=env, capture_output=True, text=True)
    print(probe.stderr.strip().splitlines()[-1] if probe.stderr.strip() else "heavy imported: ?")
    print(
        f"{root}: validate {len(files)} bundled patchsets: median {statistics.median(times):.2f} s "
        f"over {args.runs} fresh interpreters ({os.cpu_count()} CPUs, Python {sys.version.split()[0]})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
