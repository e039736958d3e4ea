"""Compare an unpatched and a patched run of transformers' tests, test by test; render docs/hf_tests.md.

Engine-free and torch-free (only json and the results the plugin wrote), so the page is regenerated
from the committed summary in a second: ``python tests/hf_suite/run.py render``.

A patched run is judged against the unpatched run of the same file (``off``), never against zero
failures: some tests fail unpatched too (they need the hub, or a GPU, or are transformers' own
bugs). A test *differs* when its outcome differs, when it fails in both runs with another
exception type (the same failure, with other numbers in its message, is the same failure), or when
its subtests' outcomes differ (transformers marks some tests xfail as a whole: a subtest failing for
another reason shows there only). A row is
also a harness failure (:func:`problems`) when its patched run patched no model (the run tested
nothing of ours), when ``engine.apply`` raised something other than a planner refusal, or when
pytest itself did not finish normally.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

__all__ = ["compare", "load", "problems", "render", "summarize"]

#: pytest's exit statuses that mean "the tests ran" (0: all passed, 1: some failed).
FINISHED = (0, 1)
NO_TESTS_COLLECTED = 5  # pytest's exit status when a -k selection matches no test of the file
#: The outcomes counted in the table's columns.
COLUMNS = ("passed", "failed", "skipped")


def load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))


def _exception(message: str) -> str:
    """The exception type a failure message starts with (``AssertionError: ...`` -> ``AssertionError``)."""
    head = message.split(":", 1)[0].strip()
    if head.startswith("subtest "):  # "subtest [msg] (kwargs): AssertionError: ..."
        head = message.split(": ", 2)[1] if message.count(": ") >= 2 else head
    return head if head.replace(".", "").replace("_", "").isalnum() else message[:80]


def _tally(test: dict[str, Any]) -> str:
    return ", ".join(f"{n} {outcome}" for outcome, n in sorted(test.get("subtests", {}).items())) or "none"


def counts(tests: dict[str, dict[str, Any]]) -> dict[str, int]:
    """passed / failed / skipped, where errors count as failed and xfailed / xpassed stay apart."""
    found = Counter(t["outcome"] for t in tests.values())
    return {"passed": found["passed"], "failed": found["failed"] + found["error"], "skipped": found["skipped"],
            "xfailed": found["xfailed"], "xpassed": found["xpassed"]}


def compare(off: dict[str, Any], patched: dict[str, Any]) -> dict[str, Any]:
    """Test by test, ``patched`` against ``off``, over the tests the patched run selected.

    Returns the counts of both runs over those tests, and each difference with both messages.
    """
    mine = patched["tests"]
    base = {k: v for k, v in off["tests"].items() if k in mine}
    differences = []
    for nodeid in sorted(set(mine) | set(base)):
        a, b = base.get(nodeid), mine.get(nodeid)
        if a is None or b is None:
            differences.append({"test": nodeid, "unpatched": a["outcome"] if a else "not run",
                                "patched": b["outcome"] if b else "not run",
                                "message": (b or a or {}).get("message", "")})
            continue
        same = a["outcome"] == b["outcome"]
        if same and a["outcome"] in ("failed", "error"):
            same = _exception(a.get("message", "")) == _exception(b.get("message", ""))
        message = b.get("message", "")
        if same and a.get("subtests", {}) != b.get("subtests", {}):  # e.g. an xfail test's subtests failing otherwise
            first = b.get("subtest_message") or message or "-"
            same, message = False, f"subtests {_tally(a)} unpatched, {_tally(b)} patched; first: {first}"
        if not same:
            differences.append({"test": nodeid, "unpatched": a["outcome"], "patched": b["outcome"],
                                "unpatched_message": a.get("message", ""), "message": message})
    failing = [{"test": k, "message": base[k].get("message", "")} for k in sorted(base)
               if base[k]["outcome"] in ("failed", "error") and k in mine
               and not any(d["test"] == k for d in differences)]
    return {"unpatched": counts(base), "patched": counts(mine), "differences": differences,
            "failing_both": failing}


def problems(off: dict[str, Any] | None, patched: dict[str, Any]) -> list[str]:
    """What makes a patched run untrustworthy, whatever its outcomes: each a sentence."""
    out = []
    models = patched["models"]
    if off is None:
        out.append("no unpatched run to compare with")
    for run in (r for r in (off, patched) if r is not None):
        if run["exitstatus"] not in FINISHED:
            out.append(f"pytest did not finish its {run['mode']} run normally (exit status {run['exitstatus']})")
    if models["patched"] == 0:
        out.append(f"nothing patched: {models['built']} models built, none patched (refused: "
                   f"{dict(models['refused']) or '-'}; no patchset: {dict(models['no_patchset']) or '-'})")
    for reason, n in models["crashed"].items():
        out.append(f"engine.apply raised (not a refusal) {n}x: {reason}")
    for label, state in patched.get("compiled", {}).items():
        if state["failed"]:
            out.append(f"compiled kernel {label} failed to compile and ran the reference instead")
    return out


def summarize(family: str, mode: str, off: dict[str, Any] | None, patched: dict[str, Any]) -> dict[str, Any]:
    """One row of the table: a family in a mode, with everything the page shows about it."""
    row: dict[str, Any] = {"family": family, "mode": mode, "patchset": patched.get("patchset_override"),
                           "selection": patched.get("selection", ""), "wall_s": patched["wall_s"],
                           "off_wall_s": off["wall_s"] if off else None, "models": patched["models"],
                           "problems": problems(off, patched)}
    if off is not None:
        row.update(compare(off, patched))
    ran = [run["tests"][k] for run in (off, patched) if run is not None for k in patched["tests"]
           if k in run["tests"] and run["tests"][k]["outcome"] != "skipped"]  # over the tests this run selected
    if patched["models"]["built"] == 0 and not ran:
        if patched["tests"]:  # a file of tests that need what is not here
            first = next(iter(patched["tests"].values())).get("message", "")
            row["no_tests"] = f"every test of the file skips here, both ways ({len(patched['tests'])}; first: {first})"
            row["problems"] = [p for p in row["problems"] if not p.startswith("nothing patched")]
        elif patched["exitstatus"] == NO_TESTS_COLLECTED:  # the selection holds none of the file's tests
            row["no_tests"] = "the mode's selection holds no test of this file (pytest collected none)"
            collected_none = f"pytest did not finish its {patched['mode']} run normally (exit status {NO_TESTS_COLLECTED})"
            row["problems"] = [p for p in row["problems"] if not p.startswith("nothing patched") and p != collected_none]
    return row


def _cell(c: dict[str, int]) -> str:
    extra = "".join(f" +{c[k]} {k}" for k in ("xfailed", "xpassed") if c.get(k))
    return f"{c['passed']} / {c['failed']} / {c['skipped']}{extra}"


def cause_of(row: dict[str, Any], difference: dict[str, Any], causes: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The attributed cause of a difference (``tests/hf_suite/causes.yaml``): same family, test and mode."""
    test = difference["test"].split("::", 1)[-1]
    for cause in causes:
        if cause["family"] == row["family"] and test == cause["test"] and row["mode"] in cause.get("modes", [row["mode"]]):
            return cause
    return None


def _verdict(row: dict[str, Any], causes: list[dict[str, Any]] | None = None) -> str:
    if row["problems"]:
        return "**harness failure**"
    if row.get("no_tests"):
        return "no test runs here (below)"
    differences = row.get("differences", [])
    if differences:
        found = [cause_of(row, d, causes or []) for d in differences]
        if all(c is not None and c["owner"] == "transformers" for c in found):
            return f"same but {len(differences)}: transformers' (below)"
        return f"**{len(differences)} differ**"
    return "same"


def _models(row: dict[str, Any]) -> str:
    m = row["models"]
    refused = sum(m["refused"].values())
    return f"{m['patched']} of {m['built']}" + (f" ({refused} refused)" if refused else "")


def _kernels(row: dict[str, Any]) -> str:
    ops: dict[str, set[str]] = {}
    for key in row["models"]["kernels"]:
        op, kernel = key.split(":", 1)
        ops.setdefault(op, set()).add(kernel)
    return ", ".join(f"{op} {'/'.join(sorted(k))}" for op, k in sorted(ops.items()))


def render(summary: dict[str, Any], method: str, families: list[str] | None = None,
           selections: dict[str, str] | None = None, causes: list[dict[str, Any]] | None = None) -> str:
    """docs/hf_tests.md: ``method`` (how the runs were made), then the table and every difference.

    ``families``: every bundled family with a test file (None where the test tree is not unpacked);
    the page then says which of them the sweep has not reached in which mode, so a page of a few rows
    never reads as the whole sweep. ``selections``: each mode's sweep selection (a family counts as swept
    in a mode with a row of that selection or of the whole file). ``causes``: differences shown to be
    transformers' (``tests/hf_suite/causes.yaml``), each with its evidence.
    """
    causes = causes or []
    rows = summary["rows"]
    selections = selections or {}
    lines = [method.rstrip(), "", f"Environment of these results: {summary.get('environment', '-')}.", "",
             "## Sweep status", ""]
    if families is None:
        lines.append("(Which families are not swept yet needs the unpacked test tree: `python tests/hf_suite/run.py "
                     "setup`, then `render`.)")
    else:
        for mode in ("torch", "compiled", "interpret"):
            mine = [r for r in rows if r["mode"] == mode and not r.get("patchset")]
            whole = {r["family"] for r in mine if not r.get("selection")}
            done = whole | {r["family"] for r in mine if selections.get(mode) and r.get("selection") == selections[mode]}
            todo = [f for f in families if f not in done]
            how = (f"the sweep's selection; the whole file for {len(whole & set(families))}"
                   if selections.get(mode) else "the whole file")
            lines.append(f"- `{mode}` ({how}): {len(families) - len(todo)} of {len(families)} families swept"
                         + (f"; not yet: {', '.join(todo)}" if todo else "") + ".")
        lines.append("")
        lines.append("Resume with `nice -n 19 python tests/hf_suite/run.py sweep --jobs 2` (runs with results are "
                     "kept; `--whole` for whole files).")
    lines += ["", "## Results", "",
             "Per family and mode: passed / failed / skipped unpatched and patched (over the same tests), the",
             "models the tests built that were patched, the kernels they got, and the verdict (`same`: every",
             "test has the same outcome patched as unpatched).", "",
             "| family | mode | unpatched | patched | models patched | kernels | wall (s) | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        mode = row["mode"] + (f" ({row['patchset']})" if row.get("patchset") else "")
        if not row.get("selection"):
            mode += " (whole file)" if selections.get(row["mode"]) else ""
        elif row["selection"] != selections.get(row["mode"]):
            mode += " (-k: its own selection)"
        unpatched, patched = (_cell(row[k]) if k in row else "-" for k in ("unpatched", "patched"))
        lines.append(f"| {row['family']} | {mode} | {unpatched} | {patched} | {_models(row)} | {_kernels(row)} | "
                     f"{row['wall_s']:.0f} | {_verdict(row, causes)} |")
    flagged = [r for r in rows if r.get("differences") or r["problems"] or r.get("no_tests")]
    lines += ["", "## Differences and harness failures", ""]
    if not flagged:
        lines.append("None: in every row above, each test has the same outcome patched as unpatched.")
    for row in flagged:
        lines += [f"### {row['family']}, {row['mode']}", ""]
        lines += [f"- harness: {p}" for p in row["problems"]]
        lines += [f"- {row['no_tests']}"] if row.get("no_tests") else []
        for d in row.get("differences", []):
            test = d["test"].split("::", 1)[-1]
            lines.append(f"- `{test}`: {d['unpatched']} unpatched, {d['patched']} patched: {d['message'] or '-'}")
            if cause := cause_of(row, d, causes):
                owner = cause["owner"] + ("'" if cause["owner"].endswith("s") else "'s")
                lines.append(f"  - cause ({owner}): {cause['cause'].strip()} Evidence: {cause['evidence'].strip()}")
        lines.append("")
    lines += ["", "## Failing unpatched too", "",
              "Tests that fail the same way with and without the patches (same exception type): transformers' own",
              "failures under this environment (the hub offline, no GPU, its own bugs), not the engine's:", ""]
    failing = [(row, f) for row in rows for f in row.get("failing_both", [])]
    lines += [f"- {row['family']} ({row['mode']}) `{f['test'].split('::', 1)[-1]}`: {' '.join(f['message'].split())[:200] or '-'}"
              for row, f in failing] or ["None."]
    refusals = Counter()
    for row in rows:
        refusals.update({f"{row['family']} ({row['mode']}): {k}": v for k, v in row["models"]["refused"].items()})
    lines += ["", "## Models the planner refused", "",
              "Models the tests build that the bundled patchset of their type does not fit (they run unpatched, counted",
              "above as built but not patched), with the planner's reason:", ""]
    lines += [f"- {k}: {v}x" for k, v in sorted(refusals.items())] or ["None."]
    switches = sorted({s for row in rows for s in row["models"]["activations"]})
    lines += ["", "## Activations switched (in both runs)", ""]
    lines += [f"- {s}" for s in switches] or ["None."]
    return "\n".join(lines) + "\n"
