"""A verification's table as ``patch-engine verify`` prints it: grouped by class, op and kernel, at most 120 columns.

Why: one row a module with its class, op and kernel beside it ran to 139 columns without its note
and 194 with it on SmolLM2 (``verify llama --gguf``), so a terminal wrapped every row. The class,
op and kernel are the same for every module of a class, so they head each group once; a row is the
module, its difference per dtype, its result and its note (wrapped beneath itself, or beneath the
row where fewer than 30 columns are left). ``engine.verify``'s own ``str(report)`` keeps one line a
row (tests and scripts read it); ``--json`` has every field.
"""

from __future__ import annotations

from typing import Any

from engine.planning.tables import TABLE_WIDTH, format_table
from engine.verification.results import MODEL, _cell, _num, _short

__all__ = ["report_text", "verify_table"]

INDENT = "  "


def _groups(report: Any, detail: bool) -> list[tuple[str, list[tuple[str, ...]]]]:
    """``(title, rows)`` for each run of rows of one class, op and kernel, in the report's order."""
    dtypes = list(dict.fromkeys((*report.dtypes, report.model_dtype)))
    groups: list[tuple[tuple[str, ...], list[tuple[str, ...]]]] = []
    if detail:
        keyed = [((c.cls, c.op, "-", c.path == MODEL), (_short(c.path), c.what, c.dtype, c.kernel, _num(c.max_abs),
                  _num(c.max_rel), "ok" if c.passed else "FAIL", c.note)) for c in report.checks]
    else:
        keyed = []
        for row in report.rows():
            result = "ok" if row["passed"] else "FAIL"
            if row["passed"] and row["not_counted"]:
                result = f"ok ({'/'.join(row['not_counted'])} not counted)"
            cells = [_cell(row["errors"].get(dt), row["allowed"].get(dt)) for dt in dtypes]
            keyed.append(((row["class"], row["op"], row["kernel"], row["module"].startswith(MODEL)),
                          (_short(row["module"]), *cells, result, "; ".join(row["notes"]))))
    for key, cells in keyed:
        if groups and groups[-1][0] == key:
            groups[-1][1].append(cells)
        else:
            groups.append((key, [cells]))
    return [(_title(key, len(rows), detail), rows) for key, rows in groups]


def _title(key: tuple[str, ...], count: int, detail: bool) -> str:
    cls, op, kernel, whole = key
    if whole:
        return f"{cls}: the whole model"
    what = "function" if cls == "function" else cls
    runs = f", kernel {kernel}" if kernel and kernel != "-" else ""
    many = "" if detail or count == 1 else f"; {count} {'functions' if cls == 'function' else 'modules'}"
    return f"{what}: {op}{runs}{many}"


def verify_table(report: Any, *, detail: bool = False, width: int = TABLE_WIDTH) -> str:
    """The report's table grouped by class, op and kernel, at most ``width`` wide (module docstring)."""
    dtypes = list(dict.fromkeys((*report.dtypes, report.model_dtype)))
    headers = ("module", "check", "dtype", "kernel", "max abs", "max rel", "result", "note") if detail else \
        ("module", *(f"{dt} diff / allowed" for dt in dtypes), "result", "note")
    groups = _groups(report, detail)
    every = [cells for _, rows in groups for cells in rows]
    # every group's table with the same column widths: the headers padded to the widest cell of all groups
    padded = [h.ljust(max([len(h), *(len(r[i]) for r in every)])) for i, h in enumerate(headers)]
    lines: list[str] = []
    for n, (title, rows) in enumerate(groups):
        table = format_table(padded, rows, width=width - len(INDENT)).splitlines()
        head = _head_lines(table)
        if n == 0:
            lines += [INDENT + line for line in table[:head]]
        lines.append(title)
        lines += [(INDENT + line).rstrip() for line in table[head:]]
    return "\n".join(lines)


def _head_lines(table: list[str]) -> int:
    """How many lines the header takes (with its rule of dashes)."""
    return next(i for i, line in enumerate(table) if line and set(line) <= {"-", " "}) + 1


def report_text(report: Any, *, detail: bool = False) -> str:
    """``str(report)`` (headline, table, legend) with the grouped table; ``detail``: one row a check below it too."""
    text = str(report).replace(report.table(), verify_table(report), 1)
    return f"{text}\n\n{verify_table(report, detail=True)}" if detail else text
