"""The interpreter's verdicts vs the GPU's: the same verify, check by check, on CPU (interpreted) and on CUDA.

``python tests/gpu/interpret_vs_gpu.py [NAMES...] [--out DIR]`` on a GPU machine (tests/gpu/device_check.sh
runs it). A name may end in ``@bf16`` (a bf16 tiny model; fp32 otherwise). For each patchset: its tiny model,
one 8-token sequence, a sample of each patched class; verify
with the CUDA plan (a) on the CPU with the vendor kernels interpreted
(:mod:`engine.kernels.triton_interpret`) and (b) on the GPU. Writes ``interpret_vs_gpu.{json,md}``: per
check, pass/fail and the max abs difference on each side. Exit 1 when a verdict differs. Without a CUDA
device only (a) runs (a dry run of the script; exit 0).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: one per distinct kernel call (as .ci/interpret), plus the verdicts docs/devices.md asks a GPU to confirm
#: (glm4v's 8-token gradients; liger's fused MoE in a bf16 model, its backward's bf16 atomic_add interpreted)
DEFAULT = ("qwen3", "gemma3", "gemma", "llama4", "qwen2_5_vl", "nemotron", "deepseek_v32", "qwen3_flce",
           "glm4_moe_lite", "qwen3_5_text", "glm4v", "qwen3_moe@bf16")


def _checks(report: Any) -> dict[str, dict[str, Any]]:
    return {f"{c.path} {c.what} {c.dtype}": {"passed": bool(c.passed), "max_abs": float(c.max_abs),
                                                  "kernel": c.kernel} for c in report.checks}


def _verify(spec: str, device: str) -> dict[str, Any]:
    import torch

    import engine
    from engine.kernels.triton_interpret import interpreting
    from engine.loader import load_patchset
    from engine.tiny import build_tiny_for
    from engine.verification import probe_batch

    name, _, dtype = spec.partition("@")
    ps = load_patchset(name)
    model = build_tiny_for(ps, None, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    batch = probe_batch(model, batch=1, seq=8)
    try:
        if device == "interpret":
            with interpreting():
                report = engine.verify(model, ps, device="cuda", batch=batch, modules="sample",
                                       raise_on_failure=False)
        else:
            model = copy.deepcopy(model).to("cuda")
            report = engine.verify(model, ps, device="cuda", batch={k: v.cuda() for k, v in batch.items()},
                                   modules="sample", raise_on_failure=False)
    except Exception as exc:  # noqa: BLE001 (recorded: the run goes on to the next)
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
    return {"passed": bool(report.passed), "checks": _checks(report)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch
    import transformers  # noqa: F401  (once, before forking)

    import engine.api  # noqa: F401

    gpu = torch.cuda.is_available()
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    names = list(args.names or DEFAULT)
    # the interpreted halves first, in parallel (forked before CUDA is initialised), then the GPU's
    workers = max(1, min(len(names), (os.cpu_count() or 2) // 2))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        interpreted = dict(zip(names, pool.map(_verify, names, ["interpret"] * len(names)), strict=True))
    rows, results, differ = [], {}, []
    for name in names:
        cpu = interpreted[name]
        dev = _verify(name, "cuda") if gpu else {"error": "no CUDA device"}
        results[name] = {"interpreted": cpu, "gpu": dev}
        for key in sorted(set(cpu.get("checks", {})) | set(dev.get("checks", {}))):
            a, b = cpu.get("checks", {}).get(key), dev.get("checks", {}).get(key)
            same = a is not None and b is not None and a["passed"] == b["passed"]
            if gpu and not same:
                differ.append(f"{name}: {key}")
            cell = (lambda c: "-" if c is None else f"{'ok' if c['passed'] else 'FAIL'} {c['max_abs']:.2g}")
            rows.append(f"| {name} | {key} | {cell(a)} | {cell(b)} |")
        print(f"{name}: interpreted {cpu.get('passed', cpu.get('error'))}, gpu {dev.get('passed', dev.get('error'))}",
              flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "interpret_vs_gpu.json").write_text(json.dumps(results, indent=2))
    head = ["# Interpreted (CPU) vs GPU verdicts", "", f"GPU: {torch.cuda.get_device_name(0) if gpu else 'none'}",
            "", "| patchset | check | interpreted | GPU |", "|---|---|---|---|"]
    (out / "interpret_vs_gpu.md").write_text("\n".join(head + rows) + "\n")
    if differ:
        print("verdicts differ:\n  " + "\n  ".join(differ))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
