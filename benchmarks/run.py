"""Run the benchmark suite: ``python benchmarks/run.py [--only ops,overhead,plan,train] [--quick]``.

The same as ``patch-engine bench``; the code lives in :mod:`engine.bench` so the installed CLI has it.
Results: benchmarks/results/cpu.json and benchmarks/results/cpu.png.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.bench import main

if __name__ == "__main__":
    sys.exit(main())
