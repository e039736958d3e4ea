"""The published audit table (docs/audit.md) holds: a subset regenerated and compared with its rows.

The subset is Liger's llama (passes) and OLMo 2 (differs in bf16: its casting mode), each in fp32 and
bf16, with our patchset beside them, run as the full table runs them (a worker process per stack, one
audit per cell, Liger's Triton kernels under Triton's interpreter): about a minute of CPU (63 s measured,
four worker processes), so CI runs it as a step of its own (.ci/audit), not in the suite's 15 minutes. It runs
on the probe only (conftest.py: ``PATCH_ENGINE_AUDIT_CONDITIONS=none``): the published rows of the subset were rerun
with the conditions of use (docs/audit.md, 39 min of cell time) and kept every verdict the probe gives them, which is
what this compares.
"""

from __future__ import annotations

import io
import os
import re
from pathlib import Path

import pytest

from engine.commands.audit_render import BEGIN, END, render_markdown, render_png, replace_section
from engine.commands.audit_table import generate

ROOT = Path(__file__).resolve().parent.parent
SUBSET = ["llama", "olmo2"]


def published(stack_title: str) -> dict[str, tuple[str, str, str]]:
    """``{model type: (fp32 verdict, bf16 verdict, ours)}`` from a stack's table in docs/audit.md."""
    text = (ROOT / "docs" / "audit.md").read_text()
    section = text.split(BEGIN, 1)[1].split(END, 1)[0]
    table = section.split(f"### {stack_title}\n", 1)[1].lstrip("\n").split("\n\n", 1)[0]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = (_verdict(cells[1]), _verdict(cells[2]), cells[3])
    return rows


def _verdict(cell: str) -> str:
    return re.match(r"\**([a-z ]+?)\**(:| \(|$)", cell).group(1)  # type: ignore[union-attr]


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("PATCH_ENGINE_AUDIT_CI"),
                   reason="about a minute of CPU, four processes: run by .ci/audit (PATCH_ENGINE_AUDIT_CI=1)")
def test_a_subset_regenerated_matches_the_published_table(tmp_path: Path) -> None:
    pytest.importorskip("liger_kernel")
    data = generate({}, ("liger",), SUBSET, timeout=600, log=io.StringIO())
    cells = {(c["stack"], c["model_type"], c["dtype"]): c for c in data["cells"]}
    assert cells[("liger", "olmo2", "bf16")]["verdict"] == "differs"
    assert "computes cast: llama where Olmo2RMSNorm.forward computes cast: fp32" in cells[("liger", "olmo2", "bf16")]["text"]
    assert any("Triton's interpreter" in e for e in cells[("liger", "llama", "fp32")]["environment"])
    rows = published("Liger")
    for model_type in SUBSET:
        ours = " / ".join(cells[("patchset", model_type, d)]["verdict"] for d in ("fp32", "bf16"))
        assert rows[model_type] == (cells[("liger", model_type, "fp32")]["verdict"],
                                    cells[("liger", model_type, "bf16")]["verdict"], ours), model_type
    # the same command's outputs: the section and the picture
    section = render_markdown(data, png="audit.png")
    assert replace_section(f"# t\n\n{BEGIN}\nold\n{END}\n", section).count(BEGIN) == 1
    render_png(data, tmp_path / "audit.png")
    assert (tmp_path / "audit.png").stat().st_size > 10_000


def test_a_table_run_resumes_from_its_cells_file(tmp_path: Path) -> None:
    """Cells in the cells file are taken from it, not run again: no worker starts when all are there."""
    from engine.commands.audit_table import _append_cell, _read_cells, _run_cells

    cells_file = tmp_path / "cells.jsonl"
    for dtype in ("fp32", "bf16"):
        _append_cell(cells_file, {"stack": "liger", "model_type": "llama", "dtype": dtype, "verdict": "passes",
                                  "text": "bit-equal", "seconds": 1.0})
    with cells_file.open("a") as f:
        f.write('{"stack": "liger", "model_ty')  # a line an interrupted run cut short
    log = io.StringIO()
    got = _run_cells("/nonexistent/python", "liger", ["llama"], ("fp32", "bf16"), 1.0, log, cells_file=cells_file)
    assert [(c["model_type"], c["dtype"], c["verdict"]) for c in got] == [("llama", "fp32", "passes"),
                                                                         ("llama", "bf16", "passes")]
    assert "2 cells from" in log.getvalue()
    assert len(_read_cells(cells_file)) == 2


def test_a_page_from_the_cells_so_far_marks_the_cells_carried_over_from_the_previous_table(tmp_path: Path) -> None:
    """``--from-cells --previous OLD.json``: a cell not measured yet is the previous table's, marked so; a measured
    one is this audit's even where the previous table differs; nothing previous enters the cells file."""
    from engine.commands.audit_table import _append_cell, _read_cells, _run_cells, carry_previous

    cells_file = tmp_path / "cells.jsonl"
    _append_cell(cells_file, {"stack": "liger", "model_type": "llama", "dtype": "fp32", "verdict": "passes",
                              "text": "bit-equal", "seconds": 1.0})
    got = _run_cells("/nonexistent/python", "liger", ["llama"], ("fp32", "bf16"), 1.0, io.StringIO(),
                     cells_file=cells_file, run=False)
    previous = [{"stack": "liger", "model_type": "llama", "dtype": d, "verdict": "differs", "text": "old",
                 "seconds": 9.0} for d in ("fp32", "bf16")]
    cells = carry_previous(got, previous)
    assert [(c["dtype"], c["verdict"], c.get("previous", False)) for c in cells] == [
        ("fp32", "passes", False), ("bf16", "differs", True)]
    assert len(_read_cells(cells_file)) == 1
    data = {"generated_in_seconds": 1.0, "command": "c", "cells": cells,
            "stacks": {"liger": {"types": ["llama"]}, "patchset": {"types": []}}}
    row = next(line for line in render_markdown(data, png="a.png").splitlines() if line.startswith("| llama "))
    assert row.endswith("| 10 s, bf16 previous audit |"), row


def test_a_type_with_one_dtype_measured_runs_the_other_only(tmp_path: Path) -> None:
    """A worker runs every dtype of the types it is given; the dtype the cells file already holds is not taken
    again (the resumed run failed on it: 'list.remove(x): x not in list')."""
    import sys

    from engine.commands.audit_table import _append_cell, _read_cells, _run_cells

    cells_file = tmp_path / "cells.jsonl"
    _append_cell(cells_file, {"stack": "patchset", "model_type": "no_such_type", "dtype": "fp32", "verdict": "passes",
                              "text": "from the file", "seconds": 1.0})
    got = _run_cells(sys.executable, "patchset", ["no_such_type"], ("fp32", "bf16"), 300.0, io.StringIO(),
                     cells_file=cells_file)
    assert [(c["dtype"], c["verdict"]) for c in got] == [("fp32", "passes"), ("bf16", "unchecked")]
    assert sorted(c["dtype"] for c in _read_cells(cells_file)) == ["bf16", "fp32"]


def test_a_page_with_some_cells_judged_under_the_conditions_says_which_rows() -> None:
    """Cells measured under the conditions of use beside cells carried over from a probe-only table: each row says
    which it is (``with conditions``, ``probe only``), and the page says how many cells had them."""
    from engine.commands.audit_render import render_markdown

    def c(stack: str, model_type: str, dtype: str, conditions: list[str] | None = None, previous: bool = False):
        out = {"stack": stack, "model_type": model_type, "dtype": dtype, "verdict": "passes", "text": "bit-equal",
               "seconds": 5.0}
        return out | ({"conditions": conditions} if conditions is not None else {}) | (
            {"previous": True} if previous else {})
    under = ["left padding", "length 17"]
    cells = [c("liger", "llama", d, under) for d in ("fp32", "bf16")] + [c("patchset", "llama", d, under)
                                                                       for d in ("fp32", "bf16")]
    cells += [c("liger", "qwen3", d, under) for d in ("fp32", "bf16")]
    cells += [c("patchset", "qwen3", d, previous=True) for d in ("fp32", "bf16")]
    cells += [c(s, "mistral", d, previous=True) for s in ("liger", "patchset") for d in ("fp32", "bf16")]
    data = {"generated_in_seconds": 1.0, "command": "c", "cells": cells,
            "stacks": {"liger": {"types": ["llama", "mistral", "qwen3"]}, "patchset": {"types": []}}}
    page = render_markdown(data, png="a.png")
    rows = {line.split(" | ")[0][2:]: line for line in page.splitlines() if line.startswith("| ") and " s" in line}
    assert rows["llama"].endswith("| 10 s, with conditions |"), rows["llama"]
    assert rows["qwen3"].endswith("| 10 s, with conditions; ours previous audit, probe only |"), rows["qwen3"]
    assert rows["mistral"].endswith("| 10 s, previous audit; ours previous audit, probe only |"), rows["mistral"]
    assert "6 cells were also judged under the conditions of use" in page


def test_a_cell_says_which_conditions_its_whole_model_was_judged_under() -> None:
    from engine.commands.audit_table import _conditions
    from engine.verification.results import Check

    def check(what: str) -> Check:
        return Check("<model>", "LlamaForCausalLM", "model", what, "fp32", 0.0, 0.0, True, "")

    class Report:
        def __init__(self, checks: list[Check]) -> None:
            self.model_checks = checks
    checks = [check("logits (no labels)"), check("loss"), check("logits [left padding]"),
              check("grads [left padding]"), check("loss [length 17]")]
    assert _conditions(Report(checks)) == ["left padding", "length 17"]
    assert _conditions(Report(checks[:2])) == []


def test_a_page_from_the_cells_keeps_a_stack_whose_venv_is_not_here_from_the_previous_table(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--from-cells --previous``: a stack whose interpreter cannot say its claims here (twinkle's venv is elsewhere)
    keeps the previous table's rows, marked, instead of losing its section."""
    from engine.commands import audit_table

    def ask(python: str, stack: str, extra: str | None = None) -> dict:
        if stack == "twinkle":  # its claims are a list of ours, its package is not here
            return {"stack": stack, "types": ["qwen3"], "version": None}
        if stack == "llamafactory-v1":
            return {"stack": stack, "types": [], "error": "ModuleNotFoundError: No module named 'llamafactory'"}
        return {"stack": stack, "types": ["qwen3"], "version": "0.1.0"}
    monkeypatch.setattr(audit_table, "_ask_claims", ask)
    previous = [{"stack": s, "model_type": "qwen3", "dtype": d, "verdict": "passes", "text": "bit-equal",
                 "seconds": 2.0} for s in ("twinkle", "llamafactory-v1", "patchset") for d in ("fp32", "bf16")]
    stacks = {s: {"stack": s, "types": ["qwen3"], "version": "0.5.1", "seconds": 358.2}
              for s in ("twinkle", "llamafactory-v1")}
    data = audit_table.generate({}, ("twinkle", "llamafactory-v1"), None, 1.0, log=io.StringIO(),
                                cells_file=tmp_path / "c.jsonl", run=False, previous=previous, previous_stacks=stacks)
    assert [(data["stacks"][s]["version"], data["stacks"][s]["seconds"]) for s in stacks] == [("0.5.1", 358.2)] * 2
    assert sorted((c["stack"], c["dtype"], c.get("previous")) for c in data["cells"]) == [
        (s, d, True) for s in ("llamafactory-v1", "patchset", "twinkle") for d in ("bf16", "fp32")]
    assert "### twinkle" in render_markdown(data, png="a.png")
