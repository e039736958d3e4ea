"""The published audit table: every model type each stack claims x fp32/bf16, beside our patchset's result.

One command regenerates ``docs/audit.md``'s table, ``benchmarks/results/audit.json`` and
``benchmarks/results/audit.png``::

    python -m engine.commands.audit_table --python twinkle=VENV/bin/python --python llamafactory-v1=VENV/bin/python

Each stack runs in the interpreter given for it (twinkle and LlamaFactory pin libraries this venv
cannot hold), as a worker process of this module (``worker``: one JSON line per cell) with this
checkout on ``PYTHONPATH``; a stack with no interpreter that imports it has every row unchecked,
with the reason. Each cell is one :func:`engine.audit` of the tiny model of the type (the one
``verify`` builds) in that dtype; "ours" is the same audit of our bundled patchset
(``patchset:NAME``) in this interpreter. A worker that dies or stays silent past ``--timeout``
seconds has that cell unchecked and is started again for the rest.

Every finished cell is appended to a cells file (``--cells``, default ``.audit-table/cells.jsonl``)
as it arrives, and a cell already there is not run again (``--again`` reruns them all): the whole
table takes hours on 2 cores, so an interrupted run resumes where it stopped, and runs of different
stacks (one per venv, in parallel) share "ours" instead of each auditing our patchsets again.

``--from-cells --previous OLD.json`` writes the table of what the cells file holds and fills each cell
it lacks from an earlier results file, marked ``previous`` (the page says which: an earlier version of
the audit may have judged it otherwise); a previous cell is never taken as measured, so a later run
still audits it.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

__all__ = ["cell", "main"]

ROOT = Path(__file__).resolve().parents[2]
STACKS = ("liger", "hf-kernels", "twinkle", "llamafactory-v1")
DTYPES = ("fp32", "bf16")


def cell(stack: str, model_type: str, dtype: str) -> dict[str, Any]:
    """One audit of ``stack`` (or ``patchset``: ours) on the tiny ``model_type`` in ``dtype``, as a table cell."""
    import torch

    from engine.auditing import audit
    from engine.auditing.adapters import NotClaimed, resolve
    from engine.commands.audit import tiny_model

    started = time.perf_counter()
    out: dict[str, Any] = {"stack": stack, "model_type": model_type, "dtype": dtype}
    try:
        if stack == "patchset":
            from engine.auditing.adapters.patchset import bundled_by_type

            adapter = resolve("patchset:" + bundled_by_type()[model_type], model_type)
        else:
            adapter = resolve(stack, model_type)
    except NotClaimed as exc:
        return {**out, "verdict": "not claimed", "text": str(exc)[:200], "seconds": 0.0}
    except Exception as exc:  # noqa: BLE001  (a bundled name that does not load, a stack that does not import)
        return {**out, "verdict": "unchecked", "text": f"{type(exc).__name__}: {_short(exc)}", "seconds": 0.0}
    if not _buildable(model_type):
        return {**out, "verdict": "unchecked", "text": "no causal LM of this type in transformers (AutoModelForCausalLM "
                "does not map it) and no bundled tiny model: nothing here to run", "seconds": 0.0}
    try:
        model = tiny_model(model_type, {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]).train()
    except Exception as exc:  # noqa: BLE001
        return {**out, "verdict": "unchecked", "text": f"no tiny {model_type} model here: {type(exc).__name__}: "
                f"{_short(exc)}", "seconds": round(time.perf_counter() - started, 1)}
    try:
        report = audit(model, adapter)
    except Exception as exc:  # noqa: BLE001  (the audit itself failed on this model: unchecked, with why)
        return {**out, "verdict": "unchecked", "text": f"the audit failed: {type(exc).__name__}: {_short(exc)}",
                "seconds": round(time.perf_counter() - started, 1)}
    return {**out, "verdict": report.verdict, "text": _cell_text(report), "worst_ratio": _finite(report.worst_difference),
            "summary": report.summary(), "environment": report.environment, "patch": report.patch,
            "reading": report.reading, "reading_only": report.reading_only, "conditions": _conditions(report),
            "model_ratios": {k: _finite(v) for k, v in report.model_ratios.items()},
            "seconds": round(time.perf_counter() - started, 1)}


def _conditions(report: Any) -> list[str]:
    """The conditions of use the cell's whole model was judged under (``[]``: the probe only), in the order run."""
    from engine.verification.conditions import condition_of

    return [n for n in dict.fromkeys(condition_of(c.what) for c in report.model_checks) if n]


def _buildable(model_type: str) -> bool:
    """Whether a tiny model of the type can be built here: a causal LM transformers maps, or a bundled tiny model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from engine.auditing.adapters.patchset import bundled_by_type

    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or model_type in bundled_by_type()


def _cell_text(report: Any) -> str:
    """What a table cell says: the verdict, where and by how much, and the declaration that explains it."""
    if report.verdict == "error":
        return f"the patch raised {report.error[:160]}"
    if report.verdict == "unchanged":
        return "changes nothing in this model"
    worst = report.worst_ratio
    if report.verdict == "passes":
        if worst is None or worst == 0.0:
            return "bit-equal" if worst == 0.0 else "within the original's own error"
        return f"within {worst:.2g}x the original's own error"
    rows = [r for r in report.rows if r.result == report.verdict]
    if report.verdict == "unchecked":
        why = rows[0].note if rows else report.model_problem or ""
        return f"{rows[0].cls}: {why[:160]}" if rows else why[:160]
    # every finding, not only the worst: the summary's, exact arithmetic first, a reading's labelled apart
    return report.summary().split(": differs: ", 1)[-1][:900]


def _finite(x: float | None) -> float | None:
    import math

    return x if x is not None and math.isfinite(x) else None


def _short(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + "..."


def claims(stack: str) -> dict[str, Any]:
    """The model types ``stack`` claims, and the versions it runs with (in this interpreter)."""
    from engine.auditing.adapters import claims as stack_claims
    from engine.foundation.versions import installed_version

    package = {"liger": "liger-kernel", "hf-kernels": "kernels", "twinkle": "twinkle-kit",
               "llamafactory-v1": "llamafactory", "patchset": "patch-engine"}[stack]
    return {"stack": stack, "types": stack_claims(stack), "version": installed_version(package),
            "transformers": installed_version("transformers"), "torch": installed_version("torch")}


# ---------------------------------------------------------------------------------------- running workers


def _worker_main(args: argparse.Namespace) -> int:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    if args.claims:
        print(json.dumps(claims(args.stack)), flush=True)
        return 0
    for model_type in args.types.split(","):
        for dtype in args.dtypes.split(","):
            print(json.dumps({"start": [args.stack, model_type, dtype]}), flush=True)
            print(json.dumps(cell(args.stack, model_type, dtype)), flush=True)
    return 0


def _env(extra: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), extra, env.get("PYTHONPATH")) if p)
    return env


def _ask_claims(python: str, stack: str, extra: str | None = None) -> dict[str, Any]:
    done = subprocess.run([python, "-m", "engine.commands.audit_table", "worker", "--stack", stack, "--claims"],
                          check=False, cwd=ROOT, env=_env(extra), capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"stack": stack, "types": [], "error": (done.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(lines[-1])


def _run_cells(python: str, stack: str, types: list[str], dtypes: tuple[str, ...], timeout: float,
               log: Any, extra: str | None = None, cells_file: Path | None = None, run: bool = True,
               ) -> list[dict[str, Any]]:
    """Every (type, dtype) of ``stack`` in worker processes; a dead or silent worker costs its cell only.

    With ``cells_file``: the cells of ``stack`` already in it are taken from it (read now, so a run of
    another stack that wrote them meanwhile counts), and each new cell is appended the moment it arrives.
    """
    known = {(c["model_type"], c["dtype"]): c for c in _read_cells(cells_file) if c["stack"] == stack}
    results: list[dict[str, Any]] = [known[(t, d)] for t in types for d in dtypes if (t, d) in known]
    pending = [(t, d) for t in types for d in dtypes if (t, d) not in known]
    if results:
        print(f"{stack}: {len(results)} cells from {cells_file}", file=log, flush=True)
    if not run:  # the table of what is measured so far: the rest says so, and stays to run
        return results + [{"stack": stack, "model_type": t, "dtype": d, "verdict": "not run",
                           "text": "not measured yet (the command resumes from its cells file)", "seconds": 0.0}
                          for t, d in pending]

    def record(data: dict[str, Any]) -> None:
        results.append(data)
        _append_cell(cells_file, data)
    while pending:
        todo = sorted({t for t, _ in pending}, key=[t for t, _ in pending].index)
        proc = subprocess.Popen(
            [python, "-m", "engine.commands.audit_table", "worker", "--stack", stack, "--types", ",".join(todo),
             "--dtypes", ",".join(dtypes)], cwd=ROOT, env=_env(extra), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True)
        current: tuple[str, str] | None = None
        deadline = time.monotonic() + timeout
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(proc, lines), daemon=True).start()
        while True:
            try:
                line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                proc.kill()
                proc.wait()
                break
            if line is None:  # the worker's output ended: it is done, or dead
                proc.wait()
                break
            if not line.startswith("{"):
                continue
            data = json.loads(line)
            if "start" in data:
                current, deadline = (data["start"][1], data["start"][2]), time.monotonic() + timeout
                continue
            if (data["model_type"], data["dtype"]) not in pending:
                continue  # a worker runs every dtype of a type: the other dtype's cell came from the cells file
            record(data)
            pending.remove((data["model_type"], data["dtype"]))
            print(f"{stack} {data['model_type']} {data['dtype']}: {data['verdict']} ({data['seconds']} s)",
                  file=log, flush=True)
        if current is not None and current in pending:  # the worker died or hung on this cell
            why = f"no answer within {timeout:.0f} s" if proc.returncode in (-9, None) else \
                f"the worker process died (exit code {proc.returncode})"
            record({"stack": stack, "model_type": current[0], "dtype": current[1], "verdict": "unchecked",
                    "text": why, "seconds": timeout})
            pending.remove(current)
        elif proc.returncode and pending and current is None:
            results += [{"stack": stack, "model_type": t, "dtype": d, "verdict": "unchecked",
                         "text": f"the worker could not start (exit code {proc.returncode})", "seconds": 0.0}
                        for t, d in pending]
            pending = []
    return results


def _pump(proc: subprocess.Popen[str], lines: queue.Queue[str | None]) -> None:
    """Every line the worker prints, then ``None`` when its output ends."""
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put(line.strip())
    lines.put(None)


def _read_cells(cells_file: Path | None) -> list[dict[str, Any]]:
    """The cells a cells file holds (the last of each stack, type and dtype wins); none without one."""
    if cells_file is None or not cells_file.exists():
        return []
    cells: dict[tuple[str, str, str], dict[str, Any]] = {}
    for line in cells_file.read_text().splitlines():
        try:
            cell = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by an interrupted run: that cell runs again
            continue
        cells[(cell["stack"], cell["model_type"], cell["dtype"])] = cell
    return list(cells.values())


def _append_cell(cells_file: Path | None, cell: dict[str, Any]) -> None:
    """One line per cell, appended and flushed at once (runs of several stacks may share the file)."""
    if cells_file is None:
        return
    cells_file.parent.mkdir(parents=True, exist_ok=True)
    with cells_file.open("a") as f:
        f.write(json.dumps(cell) + "\n")


def _seconds(cells: list[dict[str, Any]], wall: float) -> float:
    """The time cells took: the wall clock, or their own times' sum where they came from a cells file."""
    return round(max(wall, sum(c.get("seconds", 0.0) for c in cells)), 1)


def carry_previous(cells: list[dict[str, Any]], previous: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each ``not run`` cell replaced by the earlier results' cell of its stack, type and dtype, marked ``previous``.

    Why: the whole table takes hours; a page written from the cells measured so far keeps the earlier
    run's cells where nothing newer exists, each marked so the page can say it was not regenerated.
    """
    old = {(c["stack"], c["model_type"], c["dtype"]): c for c in previous if c["verdict"] != "not run"}
    out = []
    for c in cells:
        earlier = old.get((c["stack"], c["model_type"], c["dtype"])) if c["verdict"] == "not run" else None
        out.append({**earlier, "previous": True} if earlier else c)
    return out


def generate(pythons: dict[str, str], stacks: tuple[str, ...], only: list[str] | None, timeout: float,
             log: Any = sys.stderr, paths: dict[str, str] | None = None, cells_file: Path | None = None,
             run: bool = True, previous: list[dict[str, Any]] | None = None,
             previous_stacks: dict[str, Any] | None = None) -> dict[str, Any]:
    """Claims, then every cell, then ours for every type any stack claims; returns the results file's content.

    ``pythons``: a stack's interpreter (default: this one); ``paths``: a folder put on that stack's
    ``PYTHONPATH`` (twinkle's venv has no liger-kernel: a folder linking this venv's gives it its liger fallbacks).
    ``run=False``: audit nothing, only what ``cells_file`` holds (the rest ``not run``, or from ``previous``,
    marked so). The stacks' and the whole table's times are then the sums of their current cells' times,
    as they are when every cell came from the file. ``previous_stacks`` (with ``run=False``): a stack whose
    interpreter cannot say its claims here or has not the package (twinkle's venv is not on this machine) takes
    them, its versions and its time from the earlier results, so its rows stay on the page as the previous table's instead of vanishing.
    """
    started = time.perf_counter()
    paths = paths or {}
    info: dict[str, Any] = {}
    cells: list[dict[str, Any]] = []
    for stack in stacks:
        python, extra = pythons.get(stack, sys.executable), paths.get(stack)
        info[stack] = _ask_claims(python, stack, extra) | {"python": python, "extra_path": extra}
        if not run and stack in (previous_stacks or {}) and (info[stack].get("error") or not info[stack].get("version")):
            info[stack] = {**previous_stacks[stack], "previous": True}  # type: ignore[index]
        types = [t for t in info[stack]["types"] if only is None or t in only]
        print(f"{stack}: {len(types)} model types ({python})", file=log, flush=True)
        stack_started = time.perf_counter()
        stack_cells = _run_cells(python, stack, types, DTYPES, timeout, log, extra, cells_file, run)
        cells += stack_cells
        if not info[stack].get("previous"):  # a stack not here keeps the time its table took
            info[stack]["seconds"] = _seconds(stack_cells, time.perf_counter() - stack_started)
    ours_info = _ask_claims(sys.executable, "patchset")
    union = sorted({c["model_type"] for c in cells if c["verdict"] != "not claimed"} & set(ours_info["types"]))
    ours_started = time.perf_counter()
    ours = _run_cells(sys.executable, "patchset", union, DTYPES, timeout, log, cells_file=cells_file, run=run)
    cells += ours
    info["patchset"] = ours_info | {"python": sys.executable, "seconds": _seconds(ours, time.perf_counter() - ours_started)}
    options = [f"--python {k}={v}" for k, v in pythons.items()] + [f"--path {k}={v}" for k, v in paths.items()]
    seconds = _seconds(cells, time.perf_counter() - started)
    if previous is not None:
        cells = carry_previous(cells, previous)
    return {"generated_in_seconds": seconds, "stacks": info, "cells": cells,
            "command": " ".join(["python -m engine.commands.audit_table", *options])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.commands.audit_table", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    w = sub.add_parser("worker", help="(internal) run cells of one stack here, one JSON line each")
    w.add_argument("--stack", required=True)
    w.add_argument("--types", default="")
    w.add_argument("--dtypes", default=",".join(DTYPES))
    w.add_argument("--claims", action="store_true")
    parser.add_argument("--python", action="append", default=[], metavar="STACK=PATH",
                        help="the interpreter of a stack's venv (twinkle, llamafactory-v1); default: this one")
    parser.add_argument("--path", action="append", default=[], metavar="STACK=DIR",
                        help="a folder put on that stack's PYTHONPATH (e.g. one linking liger-kernel for twinkle)")
    parser.add_argument("--stacks", default=",".join(STACKS))
    parser.add_argument("--types", help="only these model types (comma-separated)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a cell may take (default 900)")
    parser.add_argument("--results", default=str(ROOT / "benchmarks" / "results" / "audit.json"))
    parser.add_argument("--docs", default=str(ROOT / "docs" / "audit.md"))
    parser.add_argument("--png", default=str(ROOT / "benchmarks" / "results" / "audit.png"))
    parser.add_argument("--cells", default=str(ROOT / ".audit-table" / "cells.jsonl"),
                        help="each finished cell is appended here; cells already here are not run again")
    parser.add_argument("--again", action="store_true", help="run every cell, even those in --cells")
    parser.add_argument("--from-cells", action="store_true",
                        help="audit nothing: the table of what --cells holds (the other cells 'not run')")
    parser.add_argument("--previous", metavar="RESULTS.json",
                        help="with --from-cells: cells the cells file lacks taken from this earlier results file, "
                             "marked 'previous'")
    args = parser.parse_args(argv)
    if args.command == "worker":
        return _worker_main(args)
    from engine.commands.audit_render import render_markdown, render_png, replace_section

    pythons = dict(item.split("=", 1) for item in args.python)
    paths = dict(item.split("=", 1) for item in args.path)
    cells_file = Path(args.cells)
    if args.again:
        cells_file.unlink(missing_ok=True)
    if args.previous and not args.from_cells:
        parser.error("--previous fills a --from-cells table; a run audits every cell it lacks")
    earlier = json.loads(Path(args.previous).read_text()) if args.previous else None
    data = generate(pythons, tuple(args.stacks.split(",")), args.types.split(",") if args.types else None, args.timeout,
                    paths=paths, cells_file=cells_file, run=not args.from_cells,
                    previous=earlier["cells"] if earlier else None, previous_stacks=earlier["stacks"] if earlier else None)
    if args.from_cells:  # the command that wrote this page: its cells were measured by earlier runs of it
        data["command"] += " --from-cells" + (f" --previous {args.previous}" if args.previous else "")
    Path(args.results).write_text(json.dumps(data, indent=1) + "\n")
    render_png(data, Path(args.png))
    docs = Path(args.docs)
    docs.write_text(replace_section(docs.read_text(), render_markdown(data, png=os.path.relpath(args.png, docs.parent))))
    print(f"wrote {args.results}, {args.png}, {args.docs} ({data['generated_in_seconds']} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
