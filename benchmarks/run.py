"""Run the benchmark suite: ``python benchmarks/run.py [--only ops,overhead,plan,train] [--quick]``.

The same as ``patch-engine bench``; the code lives in :mod:`engine.commands.bench` so the installed CLI has it.
Results: benchmarks/results/cpu.json and benchmarks/results/cpu.png.

``--device cuda`` runs the accelerator suite instead (benchmarks/device_suite.py: training step
vs Liger-Kernel as the peer, MoE layer; results benchmarks/results/cuda.*), and ``--dry-run``
runs that suite at tiny sizes on the CPU.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

if __name__ == "__main__":
    argv = sys.argv[1:]
    if "--dry-run" in argv or any(a == "--device" or a.startswith("--device=") for a in argv):
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from device_suite import main as device_main

        sys.exit(device_main(argv))
    from engine.commands.bench import main

    sys.exit(main())
