"""Verify every bundled patchset with its CUDA plan, the vendor kernels run by Triton's CPU interpreter.

``python tests/interpret_all.py [NAMES...] [--jobs 2] [--dtype bf16] [--json out.json]`` (``.ci/interpret`` runs it).
Each patchset is applied to its tiny model with ``device="cuda"`` inside
:func:`engine.kernels.triton_interpret.interpreting` and verified as usual (every patched class
sampled, modules in fp32 and bf16, then the whole model), on one sequence of 8 tokens: the
interpreter runs each Triton program in Python, so the batch is kept small. Models are fp32 unless
``--dtype bf16`` (the whole-model check then runs in bf16, where `auto` keeps liger's fused MoE). A
patchset whose CUDA plan picks no vendor kernel is skipped (its CPU verification is the same run).

Exit 0 when every patchset passes or fails exactly as ``docs/devices.md`` (section "Interpreted
on CPU", measured on fp32 models) says it does; 1 otherwise, listing what differs. In bf16 every
patchset must pass.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
VENDOR = ("liger", "fla")
#: The conditions of use each interpreted verification runs (see the call below for why these two).
INTERPRETED_CONDITIONS = ("length 17", "ignored labels")


def _one(name: str, dtype: str = "fp32") -> dict[str, Any]:
    """Verify one patchset interpreted; a dict of what happened (never raises)."""
    import torch

    from engine.api import apply, revert
    from engine.kernels.triton_interpret import interpreting
    from engine.loader import load_patchset
    from engine.tiny import build_tiny_for
    from engine.verification import probe_batch, verify

    torch.set_num_threads(1)
    start = time.perf_counter()
    out: dict[str, Any] = {"patchset": name}
    try:
        ps = load_patchset(name)
        model = build_tiny_for(ps, None, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
        with interpreting():
            report = apply(model, ps, device="cuda")
            try:
                kernels = sorted({f"{d.op}:{d.kernel}" for d in report.decisions
                                  if d.action == "patch" and d.kernel in VENDOR})
                out["kernels"] = kernels
                if not kernels:
                    out["result"] = "skipped"
                    return out
                # Two conditions of use, those a Triton kernel's tiling and fused loss meet: a length past one
                # 16-row tile and -100 labels (engine/_data/conditions.yaml). Not all 25: interpreted, each
                # costs tens of seconds, and the rest judge the model's code paths, which `verify` checks uninterpreted.
                verdict = verify(model, batch=probe_batch(model, batch=1, seq=8), modules="sample",
                                 raise_on_failure=False, conditions=INTERPRETED_CONDITIONS)
            finally:
                revert(model)
        out["result"] = "passed" if verdict.passed else "failed"
        if not verdict.passed:
            out["failed"] = [f"{c.path} ({c.op}, {c.kernel}, {c.dtype} {c.what}): {c.note}"
                             for c in verdict.checks if not c.passed]
    except Exception as exc:  # noqa: BLE001 (the interpreter's error, to be named in docs/devices.md)
        out["result"] = "error"
        out["error"] = f"{type(exc).__name__}: {exc}"[:600]
        out["where"] = traceback.format_exc(limit=-12)[-4000:]
    finally:
        out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def _preload() -> None:
    """Import once in the parent, so each forked child starts warm (imports are seconds per process)."""
    import torch
    import transformers  # noqa: F401

    import engine.api
    import engine.kernels.fla
    import engine.kernels.liger
    import engine.tiny  # noqa: F401

    torch.set_num_threads(1)
    for module in ("liger_kernel.ops.rms_norm", "liger_kernel.ops.swiglu", "liger_kernel.ops.rope", "fla.ops"):
        try:
            __import__(module)
        except Exception:  # noqa: BLE001, S110 (a missing package: the patchsets that need it say so)
            pass


def _child(name: str, dtype: str, conn: Any) -> None:
    conn.send(_one(name, dtype))
    conn.close()


def _forked(names: list[str], jobs: int, dtype: str = "fp32") -> Any:
    """``_one(name)`` for each name in a forked child (``jobs`` at a time), in order; a child that dies
    (the interpreter dereferencing a bad pointer kills the process) is reported, not fatal."""
    ctx = multiprocessing.get_context("fork")
    running: list[tuple[str, Any, Any, float]] = []
    done: dict[str, dict[str, Any]] = {}
    pending = list(names)
    order = list(names)
    while pending or running:
        while pending and len(running) < jobs:
            name = pending.pop(0)
            parent, child = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_child, args=(name, dtype, child))
            proc.start()
            child.close()
            running.append((name, proc, parent, time.perf_counter()))
        for item in list(running):
            name, proc, conn, started = item
            if conn.poll(0.2):
                try:
                    done[name] = conn.recv()
                except EOFError:
                    done[name] = {"patchset": name, "result": "error", "seconds": 0.0,
                                  "error": "the child died before it reported"}
                proc.join()
                running.remove(item)
            elif not proc.is_alive():
                proc.join()
                done[name] = {"patchset": name, "result": "error", "seconds": round(time.perf_counter() - started, 1),
                              "error": f"the process died (exit code {proc.exitcode}: signal {-proc.exitcode} when "
                                       "negative), e.g. the interpreter reading a pointer outside the tensor"}
                running.remove(item)
        while order and order[0] in done:
            yield done.pop(order.pop(0))


#: A row of the table whose reason starts with this is a whole-model judgement on one 8-token batch
#: within a few percent of the limit, with other batches passing (``benchmarks/interpret_judge_control.py``
#: says how far): how the original and the kernel happen to round on that batch depends on the CPU's
#: own kernels (its BLAS path), so such a row may pass on another machine and is accepted either way.
BORDERLINE = "Borderline"


def known_failures(text: str | None = None) -> dict[str, str]:
    """``patchset -> reason`` from the table under ``### Interpreted on CPU`` in docs/devices.md."""
    text = text if text is not None else (ROOT / "docs" / "devices.md").read_text()
    section = text.split("### Interpreted on CPU", 1)[-1] if "### Interpreted on CPU" in text else ""
    found = {}
    for line in section.splitlines():
        m = re.match(r"\|\s*`([a-z0-9_]+)`\s*\|\s*(.+?)\s*\|\s*$", line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="patchsets (default: every bundled one)")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the tiny models' dtype")
    parser.add_argument("--json", help="write every result here")
    args = parser.parse_args(argv)
    names = args.names or sorted(p.stem for p in (ROOT / "patchsets").glob("*.yaml"))
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _preload()
    start = time.perf_counter()
    results = []
    for res in _forked(names, args.jobs, args.dtype):
        results.append(res)
        line = f"{res['patchset']:28s} {res['result']:8s} {res['seconds']:6.1f}s  {' '.join(res.get('kernels', []))}"
        print(line, flush=True)
        for detail in res.get("failed", []) + ([res["error"]] if "error" in res else []):
            print(f"    {detail}", flush=True)
    known = known_failures() if args.dtype == "fp32" else {}
    unexpected = [r["patchset"] for r in results if r["result"] in ("failed", "error") and r["patchset"] not in known]
    fixed = [r["patchset"] for r in results if r["result"] in ("passed", "skipped") and r["patchset"] in known
             and not known[r["patchset"]].startswith(BORDERLINE)]
    counts = {k: sum(r["result"] == k for r in results) for k in ("passed", "failed", "error", "skipped")}
    print(f"interpreted verify: {counts} in {time.perf_counter() - start:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if unexpected:
        print(f"FAILED, not listed in docs/devices.md (Interpreted on CPU): {unexpected}")
    if fixed:
        print(f"listed in docs/devices.md as failing, but now pass: {fixed}; remove their rows")
    return 1 if unexpected or fixed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
