"""What the conditions of use cost (issue 46): each condition's own time, apply's self-verification and the audit.

The conditions of use (``engine/_data/conditions.yaml``) rerun the whole model under each condition. Their ``cost``
(the condition's time in runs of the probe's whole-model check) is what the budget of ``apply``'s self-verification
and zero configuration estimates with: a condition runs while ``cost x probe seconds`` keeps the total within
``budget_s``. This script measures, in one process, side by side, on the tiny models the suite uses
(``tests/conftest.py`` ``tiny_for``: the patchset's ``tiny_model``, seed 0, fp32, train mode):

1. ``conditions``: per model and condition, ``engine.verify(tiny, name, device="cpu", conditions=[condition])``
   against ``conditions=None`` (the probe alone). Two numbers per condition: ``own_s``, the time verify spent
   inside the conditions' step (``engine.verification.runner._under_conditions``, timed by a wrapper), and
   ``delta_s``, the whole verify's median minus the probe-only verify's median (noisier: it carries the rest of
   verify's jitter). ``ratio`` is ``own_s`` over ``probe_s``, the probe's whole-model time exactly as the budget
   reads it (the ``probe_seconds`` verify passes to ``_under_conditions``), compared with the declared ``cost``.
   The probe-only verify runs before and after each repeat's conditions (its median over those runs).
2. ``apply``: the default apply's self-verification, before (``PATCH_ENGINE_CONDITIONS=none``) and after
   (``=budget``): ``engine.apply(model)`` (zero configuration) on a tiny qwen3 whose norms are a user's subclass
   (its own ``forward``: measured on a tiny copy and verified, not the bundled file), and
   ``engine.apply(model, patchset, unverified="verify")`` with the bundled qwen3 as a dict with another
   ``description`` (content CI did not verify: the release gate verifies it on a tiny qwen3). Each call with
   ``PATCH_ENGINE_CACHE_DIR`` at a fresh folder (no verdict, measurement or in-process memo reused), before and
   after alternating.
3. ``audit``: ``measure_first`` + ``audit_many`` with the bundled patchset given as someone else's patch
   (``"patchset:NAME"``: ``engine.apply`` on the audit's copy), with ``conditions=None`` (before) and
   ``"default"`` (after: every condition marked ``audit``), ``PATCH_ENGINE_AUDIT_CONDITIONS`` unset.

``--threads 1`` (the default) runs torch on one thread: on a shared 2-core machine two OpenMP threads wait on each
other at every op (``benchmarks/apply_default.py`` says how much); ``--threads 0`` keeps torch's default.

    PYTHONPATH=. python benchmarks/conditions_cost.py --out benchmarks/results/conditions_cost.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
MODELS = ["qwen3", "llama", "gemma3_text", "qwen3_moe", "mistral"]
AUDITED = ["qwen3", "llama", "gemma3_text"]
#: A declared cost this far from the measured ratio (either way) is called off.
OFF_BY = 2.0

for _name in ("PATCH_ENGINE_CONDITIONS", "PATCH_ENGINE_AUDIT_CONDITIONS", "PATCH_ENGINE_UNVERIFIED",
              "PATCH_ENGINE_UNVERIFIED_RELEASE"):
    os.environ.pop(_name, None)  # each part sets what it measures
os.environ["PATCH_ENGINE_CACHE_DIR"] = tempfile.mkdtemp(prefix="conditions-cost-")  # never the user's cache


def tiny_for(name: str) -> torch.nn.Module:
    """``tests/conftest.py``'s ``tiny_for``: the tiny, perturbed model of a bundled patchset's family (fp32, seed 0)."""
    from engine.loader import load_patchset
    from engine.tiny import build_tiny_model

    ps = load_patchset(name)
    tiny = ps.tiny_model
    model_type = (tiny.model_type if tiny and tiny.model_type else None) or ps.model_types[0]
    return build_tiny_model(model_type, dict(tiny.config if tiny else {}), dtype=torch.float32, seed=0,
                            random_buffers=tiny.random_buffers if tiny else None)


# -- what verify spends on the conditions, as the budget sees it -----------------------------------------------------

CALLS: list[dict[str, Any]] = []  # each _under_conditions call: probe seconds, its own seconds, which ran


def _install_timer() -> None:
    from engine.verification import runner

    inner = runner._under_conditions

    def timed(model: Any, batch: Any, held: Any, names: Any, probe_seconds: float, report: Any, shown: Any) -> Any:
        start = time.perf_counter()
        out = inner(model, batch, held, names, probe_seconds, report, shown)
        CALLS.append({"probe_s": probe_seconds, "own_s": time.perf_counter() - start,
                      "ran": list(report.conditions), "not_run": dict(report.conditions_not_run)})
        return out

    runner._under_conditions = timed


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


@contextmanager
def _env(**values: str) -> Any:
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -- 1. each condition's own time ------------------------------------------------------------------------------------


def conditions_cost(name: str, repeats: int) -> dict[str, Any]:
    import engine
    from engine.verification.conditions import not_applicable, table

    model = tiny_for(name).train()
    rows = {c.name: {"cost": c.cost, "own_s": [], "total_s": [], "why_not": not_applicable(model, c)} for c in table()}
    probe_total, probe_s = [], []

    def verify(conditions: Any) -> tuple[float, dict[str, Any]]:
        CALLS.clear()
        start = time.perf_counter()
        engine.verify(model, name, device="cpu", conditions=conditions)
        return time.perf_counter() - start, (CALLS[-1] if CALLS else {})

    verify(None)  # warm: first-call costs (imports, caches) are no condition's
    load = [round(x, 2) for x in os.getloadavg()]
    for _ in range(repeats):
        for c in [None, *table(), None]:
            if c is not None and rows[c.name]["why_not"]:
                continue
            seconds, call = verify(None if c is None else [c.name])
            if call:  # verify(conditions=None) does not reach _under_conditions
                probe_s.append(call["probe_s"])
            if c is None:
                probe_total.append(seconds)
                continue
            row = rows[c.name]
            row["total_s"].append(seconds)
            if c.name in call["ran"]:
                row["own_s"].append(call["own_s"])
            else:
                row["why_not"] = call["not_run"].get(c.name, "did not run")
    probe, total = _median(probe_s), _median(probe_total)
    out = []
    for cname, row in rows.items():
        entry = {"condition": cname, "cost": row["cost"]}
        if not row["own_s"]:
            entry["not_applicable"] = row["why_not"]
        else:
            own = _median(row["own_s"])
            entry.update(own_s=round(own, 4), delta_s=round(_median(row["total_s"]) - total, 4),
                         ratio=round(own / probe, 2), delta_ratio=round((_median(row["total_s"]) - total) / probe, 2),
                         own_all=[round(x, 4) for x in row["own_s"]])
        out.append(entry)
    return {"model": name, "probe_s": round(probe, 4), "probe_verify_s": round(total, 4),
            "probe_verify_all": [round(x, 4) for x in probe_total], "repeats": repeats, "conditions": out,
            "load": [load, [round(x, 2) for x in os.getloadavg()]]}


# -- 2. the default apply's self-verification, before and after ------------------------------------------------------


def _user_qwen3() -> torch.nn.Module:
    """A tiny qwen3 whose norms are a user's subclass with its own forward: zero configuration measures it."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    class UserRMSNorm(Qwen3RMSNorm):
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return super().forward(hidden_states)

    model = tiny_for("qwen3").train()
    for m in model.modules():
        if type(m) is Qwen3RMSNorm:
            m.__class__ = UserRMSNorm
    return model


def _edited_qwen3() -> dict[str, Any]:
    """The bundled qwen3 patchset as a dict with another description: content CI did not verify."""
    from engine.loader import load_patchset

    data = load_patchset("qwen3").model_dump(mode="json", exclude_none=True)
    data["description"] = "the bundled qwen3, edited (benchmarks/conditions_cost.py)"
    return data


def _apply_once(kind: str, setting: str) -> dict[str, Any]:
    import engine

    model = _user_qwen3() if kind == "zero" else tiny_for("qwen3").train()
    with _env(PATCH_ENGINE_CONDITIONS=setting, PATCH_ENGINE_CACHE_DIR=tempfile.mkdtemp(prefix="conditions-cost-")), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        CALLS.clear()
        start = time.perf_counter()
        report = (engine.apply(model, device="cpu") if kind == "zero"
                  else engine.apply(model, _edited_qwen3(), device="cpu", unverified="verify"))
        seconds = time.perf_counter() - start
    if kind == "zero":
        verdict = dict(report.zero_config.verdict or {})
    else:
        verdict = {"seconds": report.release.seconds, "checks": report.release.checks,
                   "cached": report.release.cached} if report.release is not None else {}
    if not verdict or verdict.get("cached") or not CALLS:
        raise RuntimeError(f"{kind}: apply did not self-verify: {report}")
    call = CALLS[-1]
    return {"apply_s": seconds, "verify_s": verdict.get("seconds"), "checks": verdict.get("checks"),
            "conditions_s": call.get("own_s", 0.0), "probe_s": call.get("probe_s"), "ran": call.get("ran", []),
            "over_budget": sorted(k for k, v in call.get("not_run", {}).items() if "budget" in v)}


def apply_cost(repeats: int) -> list[dict[str, Any]]:
    for kind in ("zero", "named"):
        _apply_once(kind, "none")  # warm: first-call costs
    load = [round(x, 2) for x in os.getloadavg()]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for _ in range(repeats):
        for kind in ("zero", "named"):
            for setting in ("none", "budget"):  # alternating: drift in the machine's load hits both alike
                runs.setdefault((kind, setting), []).append(_apply_once(kind, setting))
    out = []
    calls = {"zero": ("engine.apply(model)", "tiny qwen3 (user's norm subclass)"),
             "named": ('engine.apply(model, edited_qwen3, unverified="verify")', "tiny qwen3")}
    for kind, (call, model) in calls.items():
        row: dict[str, Any] = {"call": call, "model": model}
        for setting, label in (("none", "before"), ("budget", "after")):
            mine = runs[kind, setting]
            for key in ("apply_s", "verify_s", "conditions_s"):
                row[f"{label}_{key}"] = round(_median([r[key] for r in mine if r[key] is not None]), 3)
            row[f"{label}_apply_all"] = [round(r["apply_s"], 3) for r in mine]
            row[f"{label}_checks"] = mine[-1]["checks"]
            if setting == "budget":
                row["probe_s"] = round(_median([r["probe_s"] for r in mine if r["probe_s"]]), 4)
                row["conditions_ran"] = mine[-1]["ran"]
                row["over_budget"] = mine[-1]["over_budget"]
        row["difference_s"] = round(row["after_apply_s"] - row["before_apply_s"], 3)
        row["repeats"] = repeats
        row["load"] = [load, [round(x, 2) for x in os.getloadavg()]]
        out.append(row)
    return out


# -- 3. the audit, before and after ----------------------------------------------------------------------------------


def _audit_once(name: str, conditions: Any) -> dict[str, Any]:
    from engine.auditing import audit_many, measure_first

    model = tiny_for(name).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        original = measure_first(model, conditions=conditions)
        measured = time.perf_counter() - start
        report = audit_many(model, [f"patchset:{name}"], original=original)[0]
        judged = time.perf_counter() - start - measured
    return {"measure_first_s": measured, "audit_many_s": judged, "total_s": measured + judged,
            "verdict": report.verdict, "conditions": len(original.conditions), "phases": dict(original.phases)}


def audit_cost(names: list[str], repeats: int) -> list[dict[str, Any]]:
    _audit_once(names[0], None)  # warm: first-call costs
    out = []
    for name in names:
        load = [round(x, 2) for x in os.getloadavg()]
        runs: dict[str, list[dict[str, Any]]] = {"before": [], "after": []}
        for _ in range(repeats):
            runs["before"].append(_audit_once(name, None))
            runs["after"].append(_audit_once(name, "default"))
        row: dict[str, Any] = {"model": name, "patch": f"patchset:{name}", "repeats": repeats}
        for label, mine in runs.items():
            for key in ("measure_first_s", "audit_many_s", "total_s"):
                row[f"{label}_{key}"] = round(_median([r[key] for r in mine]), 3)
            row[f"{label}_verdict"] = mine[-1]["verdict"]
            row[f"{label}_conditions"] = mine[-1]["conditions"]
            row[f"{label}_phases"] = mine[-1]["phases"]
        row["ratio"] = round(row["after_total_s"] / row["before_total_s"], 2)
        row["load"] = [load, [round(x, 2) for x in os.getloadavg()]]
        out.append(row)
    return out


# -- the summary -----------------------------------------------------------------------------------------------------


def suggested_costs(models: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per condition: the declared cost, the measured ratio on each model, their median, and a suggested cost (the
    median, rounded up to a tenth) where the declared one is off by more than ``OFF_BY`` on most models. The median,
    not the largest: the budget's estimate chooses what to start, and its clock stops a run whose estimate was low."""
    out: dict[str, dict[str, Any]] = {}
    for row in models[0]["conditions"]:
        name = row["condition"]
        ratios = {m["model"]: c["ratio"] for m in models for c in m["conditions"]
                  if c["condition"] == name and "ratio" in c}
        if not ratios:
            out[name] = {"cost": row["cost"], "ratios": {}, "off_on": 0, "of": 0}
            continue
        mid = statistics.median(ratios.values())
        off = sum(1 for r in ratios.values() if r > OFF_BY * row["cost"] or r < row["cost"] / OFF_BY)
        entry = {"cost": row["cost"], "ratios": ratios, "median": round(mid, 2), "max": round(max(ratios.values()), 2),
                 "off_on": off, "of": len(ratios)}
        if off > len(ratios) / 2:
            entry["suggested"] = math.ceil(mid * 10 - 1e-9) / 10
        out[name] = entry
    return out


def budget_fit(data: dict[str, Any], probe_s: float, model: str = "qwen3") -> dict[str, Any]:
    """What the budget takes on ``model`` (the conditions that applied to it in part 1, in the table's order) with a
    probe of ``probe_s`` seconds: with the declared costs and with the suggested ones (``chosen``'s rule)."""
    from engine.verification.conditions import budget_seconds

    rows = next((m["conditions"] for m in data["conditions"] if m["model"] == model), [])
    applying = [c["condition"] for c in rows if "ratio" in c]
    out: dict[str, Any] = {"applying": len(applying)}
    for label, cost in (("declared", lambda e: e["cost"]), ("suggested", lambda e: e.get("suggested", e["cost"]))):
        spent, taken = 0.0, 0
        for name in applying:
            estimate = cost(data["suggested_costs"][name]) * probe_s
            if spent + estimate <= budget_seconds():
                spent, taken = spent + estimate, taken + 1
        out[label] = {"taken": taken, "estimate_s": round(spent, 2)}
    return out


def markdown(data: dict[str, Any]) -> str:
    env = data["environment"]
    where = (f"`{env['command']}` ({env['platform']}, {env['cpus']} cores shared with other jobs, torch threads "
             f"{env['threads']}, load average {env['load_start']} at the start, {env['load_end']} at the end, "
             f"{env['date']}; {env['seconds']:.0f} s in all).")
    lines = ["## Conditions of use: what they cost", "", where, ""]
    models = data["conditions"]
    if models:
        costs = data["suggested_costs"]
        head = ("**Each condition's own time**, in runs of the probe's whole-model check (the budget's unit: `cost` x "
                f"probe seconds), median of {models[0]['repeats']}; tiny models, fp32, train mode. The probe's "
                "whole-model check (s): " + ", ".join(f"{m['model']} {m['probe_s']:.3f}" for m in models) + ".")
        lines += [head, "", "| condition | declared cost | " + " | ".join(m["model"] for m in models)
                  + " | median | suggested |", "|---|---:|" + "---:|" * len(models) + "---:|---:|"]
        for name, entry in costs.items():
            cells = []
            for m in models:
                row = next(c for c in m["conditions"] if c["condition"] == name)
                cells.append(f"{row['ratio']:.2f}" if "ratio" in row else "n/a")
            median = f"{entry['median']:.2f}" if "median" in entry else "n/a"
            lines.append(f"| {name} | {entry['cost']:g} | " + " | ".join(cells)
                         + f" | {median} | {entry.get('suggested', '')} |")
        together = " | ".join(f"{sum(c.get('ratio', 0) for c in m['conditions']):.1f}" for m in models)
        declared = sum(e["cost"] for e in costs.values())
        lines.append(f"| all that apply, together | {declared:g} (all) | {together} | | |")
        seconds = ", ".join(f"{m['model']} {sum(c.get('own_s', 0) for c in m['conditions']):.2f}" for m in models)
        lines += ["", f"Seconds, all that apply together (the conditions' own time): {seconds}.", "",
                  ("n/a: the condition does not apply to that tiny model (train mode already, no sliding window, no "
                   "router, ...). Suggested: where the declared cost is off by more than 2x on most models, the "
                   "median, rounded up to a tenth."), ""]
    if data["apply"]:
        head = ("**The default apply's self-verification**, before (`PATCH_ENGINE_CONDITIONS=none`) and after "
                f"(`=budget`), a fresh cache folder each call, median of {data['apply'][0]['repeats']}:")
        columns = "| call | before (s) | after (s) | difference (s) | of it, conditions (s) | conditions run |"
        lines += [head, "", columns, "|---|---:|---:|---:|---:|---|"]
        for r in data["apply"]:
            ran = f"{len(r['conditions_ran'])}"
            ran += f" ({len(r['over_budget'])} left out by the budget)" if r["over_budget"] else ""
            lines.append(f"| `{r['call']}` on a {r['model']} | {r['before_apply_s']:.2f} | {r['after_apply_s']:.2f} | "
                         f"{r['difference_s']:+.2f} | {r['after_conditions_s']:.2f} | {ran} |")
        if data["conditions"]:
            fits = [budget_fit(data, r["probe_s"]) for r in data["apply"]]
            lines += ["", "With the suggested costs the budget would take, of the "
                      f"{fits[0]['applying']} conditions that apply to the tiny qwen3 (at these calls' probe times, "
                      + ", ".join(f"{r['probe_s']:.2f} s" for r in data["apply"]) + "): "
                      + ", ".join(f"{f['suggested']['taken']} (estimated {f['suggested']['estimate_s']:.1f} s)"
                                  for f in fits)
                      + "; with the declared ones: " + ", ".join(f"{f['declared']['taken']}" for f in fits) + "."]
        lines.append("")
    if data["audit"]:
        head = ("**The audit**, `measure_first` + `audit_many` of the bundled patchset as someone else's patch, "
                f"conditions None (before) and \"default\" (after), median of {data['audit'][0]['repeats']}:")
        columns = ("| model | before (s) | after (s) | after / before | of after, measure_first (s) | conditions "
                   "| verdict |")
        lines += [head, "", columns, "|---|---:|---:|---:|---:|---:|---|"]
        for r in data["audit"]:
            lines.append(f"| {r['model']} | {r['before_total_s']:.1f} | {r['after_total_s']:.1f} | {r['ratio']:.1f}x | "
                         f"{r['after_measure_first_s']:.1f} | {r['after_conditions']} | {r['after_verdict']} |")
        lines.append("")
    return "\n".join(lines)


def _code() -> dict[str, Any]:
    """The commit measured, and the engine's files changed from it in the work tree (they were measured too)."""
    import subprocess

    def git(*words: str) -> str:
        out = subprocess.run(["git", "-C", str(ROOT), *words], capture_output=True, text=True, check=False)
        return out.stdout.strip() if out.returncode == 0 else ""

    changed = [line[3:] for line in git("status", "--porcelain", "--", "engine").splitlines()]
    return {"commit": git("rev-parse", "HEAD") or "unknown", "engine_changed": changed}


def _timed(label: str, fn: Callable[[], Any]) -> Any:
    start = time.perf_counter()
    out = fn()
    print(f"{label}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=MODELS, help="part 1's models (bundled patchset names)")
    parser.add_argument("--audit-models", nargs="+", default=AUDITED, help="part 3's models")
    parser.add_argument("--parts", nargs="+", default=["conditions", "apply", "audit"],
                        choices=["conditions", "apply", "audit"])
    parser.add_argument("--repeats", type=int, default=3, help="parts 1 and 2")
    parser.add_argument("--audit-repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--summarize", action="store_true", help="rewrite the summary of --out's numbers, run nothing")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/conditions_cost.json")
    args = parser.parse_args()
    if args.summarize:
        data = json.loads(args.out.read_text())
        if data["conditions"]:
            data["suggested_costs"] = suggested_costs(data["conditions"])
        args.out.write_text(json.dumps(data, indent=1) + "\n")
        args.out.with_suffix(".md").write_text(markdown(data))
        print(markdown(data))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    env = {"platform": platform.platform(), "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
           "torch": torch.__version__, "transformers": __import__("transformers").__version__,
           "load_start": [round(x, 2) for x in os.getloadavg()], "date": time.strftime("%Y-%m-%d %H:%M"),
           "command": "PYTHONPATH=. python benchmarks/conditions_cost.py " + " ".join(sys.argv[1:])}
    env.update(_code())
    _install_timer()
    data: dict[str, Any] = {"environment": env, "conditions": [], "apply": [], "audit": []}
    if "conditions" in args.parts:
        data["conditions"] = [_timed(f"conditions {m}", lambda m=m: conditions_cost(m, args.repeats))
                              for m in args.models]
        data["suggested_costs"] = suggested_costs(data["conditions"])
    if "apply" in args.parts:
        data["apply"] = _timed("apply", lambda: apply_cost(args.repeats))
    if "audit" in args.parts:
        data["audit"] = _timed("audit", lambda: audit_cost(args.audit_models, args.audit_repeats))
    env["load_end"] = [round(x, 2) for x in os.getloadavg()]
    env["seconds"] = round(time.perf_counter() - started, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    text = markdown(data)
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
