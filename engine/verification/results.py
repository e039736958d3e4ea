"""The results of a verification: one :class:`Check` per comparison, gathered in a :class:`VerifyReport`.

Pure formatting of numbers already measured: a per-module table for people, a dict for
machines, and the one-line-per-failure message of :class:`engine.errors.VerificationFailed`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.planning.report import format_table
from engine.verification.compare import FLOOR_ULPS, NOISE_FACTOR

#: The ``path`` of whole-model checks.
MODEL = "<model>"


@dataclass
class Check:
    """One comparison: a module (or function, or the whole model) in one dtype.

    ``what`` is ``declaration`` (the op's reference with the declared settings vs the
    original forward: must be bit-exact, or no alternative may fit better), ``kernel`` (the
    chosen kernel vs the original: bit-equal, or within the original's own rounding error,
    :func:`engine.verification.compare.judge`), ``called`` (the target ran at all), or, for
    ``<model>``, ``logits``, ``loss`` and ``grads`` (judged the same way). ``max_abs`` and
    ``max_rel`` are always the difference from the original; ``note`` says how it compares
    with the original's own error where they are not bit-equal. ``limit``: the most ``max_abs``
    its judge allowed (``None``: bit-equal, or judged otherwise, see the note); ``kernel``: the
    kernel whose code ran (``torch`` where a ``compiled`` kernel runs the reference); ``counted``:
    ``False`` for a failure shown but not counted (a vendor kernel in a dtype this model does not run).
    """

    path: str
    cls: str
    op: str
    what: str
    dtype: str
    max_abs: float
    max_rel: float
    passed: bool
    note: str = ""
    kernel: str = "-"
    limit: float | None = None
    counted: bool = True


def _num(x: float) -> str:
    if x == 0:
        return "0"
    if x == float("inf"):
        return "inf"
    return f"{x:.1e}"


def _cell(errors: tuple[float, float] | None, limit: float | None) -> str:
    """``0`` (bit-equal), ``1.6e-02 / 4.9e-02`` (the difference and its judge's bound), ``- `` (not checked)."""
    if errors is None:
        return "-"
    if errors[0] == 0:
        return "0"
    return f"{_num(errors[0])} / {_num(limit) if limit is not None else '-'}"


def _short(path: str) -> str:
    """A function patch's path without the ``transformers.models.`` every one of them starts with."""
    return path.removeprefix("transformers.models.")


@dataclass
class VerifyReport:
    """Every check of one verification, with a per-module table for people and a dict for machines."""

    checks: list[Check] = field(default_factory=list)
    model_dtype: str = "fp32"
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    #: Patched modules not checked one by one (``verify(modules="sample")``); 0: every one was.
    sampled: int = 0
    #: Wall time of the verification, in seconds (set by :func:`engine.verification.verify`).
    seconds: float = 0.0
    #: The conditions of use the whole model was also judged under (engine/_data/conditions.yaml), in order.
    conditions: list[str] = field(default_factory=list)
    #: Each declared condition that did not run, and why (it does not apply, or over apply's budget).
    conditions_not_run: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    def rows(self) -> list[dict[str, Any]]:
        """One row per patched module or function (worst error per dtype), then one per model check.

        A row's ``kernel`` is what ran: the planned kernel, with the dtypes where another ran
        (``compiled (fp32: torch)``); ``allowed`` per dtype is the judge's bound beside the largest
        difference (absent where bit-equal or judged otherwise); ``not_counted`` lists the dtypes of
        failures shown but not counted.
        """
        rows: dict[str, dict[str, Any]] = {}
        ran: dict[str, dict[str, str]] = {}
        wrong = _declared_wrong(self.checks)
        for c in self.checks:
            key = c.path if c.path != MODEL else f"{MODEL} {c.what.split(' ')[0]}"
            row = rows.setdefault(key, {"module": key, "class": c.cls, "op": c.op, "kernel": c.kernel,
                                        "errors": {}, "allowed": {}, "passed": True, "notes": [], "not_counted": []})
            if c.what == "kernel" and c.kernel != "-":
                ran.setdefault(key, {})[c.dtype] = c.kernel
            elif c.kernel != "-" and row["kernel"] == "-":
                row["kernel"] = c.kernel
            if c.dtype in self.dtypes or c.dtype == self.model_dtype:
                worst = row["errors"].get(c.dtype, (0.0, 0.0))
                if c.max_abs > worst[0] or c.dtype not in row["errors"]:
                    if c.limit is not None and c.max_abs > 0:
                        row["allowed"][c.dtype] = c.limit
                    else:
                        row["allowed"].pop(c.dtype, None)
                row["errors"][c.dtype] = (max(worst[0], c.max_abs), max(worst[1], c.max_rel))
            row["passed"] = row["passed"] and c.passed
            if not c.counted and c.dtype not in row["not_counted"]:
                row["not_counted"].append(c.dtype)
            note = CONSEQUENCE if c.what == "kernel" and not c.passed and c.path in wrong else c.note
            if note and note not in row["notes"] and (not c.passed or not c.counted or c.path == MODEL):
                row["notes"].append(note)
        for key, kernels in ran.items():
            row = rows[key]
            planned = row["kernel"]
            others = {dt: k for dt, k in kernels.items() if k != planned}
            if others and len(others) == len(kernels) and len(set(others.values())) == 1:
                row["kernel"] = f"{planned} (runs {next(iter(others.values()))})"
            elif others:
                row["kernel"] = f"{planned} ({', '.join(f'{dt}: {k}' for dt, k in others.items())})"
        return list(rows.values())

    def table(self, *, detail: bool = False) -> str:
        """An aligned table: one row per module (``detail``: one row per check)."""
        if detail:
            return format_table(
                ("module", "class", "op", "kernel", "check", "dtype", "max abs", "max rel", "result", "note"),
                ((c.path, c.cls, c.op, c.kernel, c.what, c.dtype, _num(c.max_abs), _num(c.max_rel),
                  "ok" if c.passed else "FAIL", c.note) for c in self.checks),
            )
        dtypes = list(dict.fromkeys((*self.dtypes, self.model_dtype)))
        body = []
        for row in self.rows():
            cells = [_cell(row["errors"].get(dt), row["allowed"].get(dt)) for dt in dtypes]
            result = "ok" if row["passed"] else "FAIL"
            if row["passed"] and row["not_counted"]:
                result = f"ok ({'/'.join(row['not_counted'])} not counted)"
            body.append((_short(row["module"]), row["class"], row["op"], row["kernel"], *cells, result,
                         "; ".join(row["notes"])))
        return format_table(
            ("module", "class", "op", "kernel", *(f"{dt} diff / allowed" for dt in dtypes), "result", "note"), body
        )

    def legend(self) -> str:
        return (
            "diff / allowed: the largest |patched - original| and the most its judge allows there (0: bit-equal;\n"
            "        '/ -': judged otherwise, see the note); kernel: what ran, e.g. compiled (runs torch) where the\n"
            "        compiled kernel does not compile in that dtype (engine/_data/compiled_rows.yaml)\n"
            "checks: declaration = the op's reference with the declared settings vs the original forward,\n"
            "        bit-exact in every dtype; kernel = the chosen kernel vs the original;\n"
            f"        {MODEL} = logits, loss and every parameter gradient vs the unpatched model ({self.model_dtype});\n"
            f"        kernel and {MODEL}: bit-equal, or |patched - original| <= {NOISE_FACTOR:g} x |original - fp64| "
            f"+ {FLOOR_ULPS:g} ulp of max|fp64|\n"
            "        (fp64: the original evaluated in fp64 on the same inputs, its fp32 casts included)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "model_dtype": self.model_dtype,
            "dtypes": list(self.dtypes),
            "judge": {"noise_factor": NOISE_FACTOR, "floor_ulps": FLOOR_ULPS, "truth": "fp64"},
            "sampled": self.sampled,
            "seconds": self.seconds,
            "conditions": {"ran": list(self.conditions), "not_run": dict(self.conditions_not_run)},
            "modules": [
                {**{k: v for k, v in row.items() if k not in ("errors", "allowed")},
                 "errors": {dt: {"max_abs": e[0], "max_rel": e[1],
                                 **({"allowed": row["allowed"][dt]} if dt in row["allowed"] else {})}
                            for dt, e in row["errors"].items()}}
                for row in self.rows()
            ],
            "checks": [vars(c) for c in self.checks],
        }

    def headline(self) -> str:
        """The verdict in one line: passed or failed, how many modules and checks, in which dtypes."""
        modules = sum(1 for r in self.rows() if not r["module"].startswith(MODEL))
        verdict = "passed" if self.passed else f"FAILED ({len(self.failures)} of {len(self.checks)} checks)"
        head = (f"verification {verdict}: {modules} patched modules and functions, {len(self.checks)} checks, "
                f"model dtype {self.model_dtype}, modules checked in {' and '.join(self.dtypes)}")
        if self.sampled:
            head += f" ({self.sampled} more patched modules not checked one by one: a sample of each class)"
        if self.conditions or self.conditions_not_run:
            n = len(self.conditions)
            head += f"; the whole model also under {n} condition{'' if n == 1 else 's'} of use"
            if self.conditions_not_run:
                head += f" ({len(self.conditions_not_run)} not run: see conditions_not_run)"
        return head

    def conditions_text(self) -> str:
        """Which conditions of use ran, and why each other did not: a line each."""
        import textwrap

        lines = [textwrap.fill(f"conditions of use run: {', '.join(self.conditions) or 'none'}", 118,
                               subsequent_indent="  ")]
        lines += [textwrap.fill(f"  not run: {name}: {why}", 118, subsequent_indent="    ")
                  for name, why in self.conditions_not_run.items()]
        return "\n".join(lines)

    def __str__(self) -> str:
        text = f"{self.headline()}\n{self.table()}\n{self.legend()}"
        return f"{text}\n{self.conditions_text()}" if self.conditions or self.conditions_not_run else text


#: A failing kernel check's note where its module's declaration failed: the kernel computes the
#: declaration, so its difference (a dtype the declaration returns included) is the same mistake.
CONSEQUENCE = "its kernel computes this declaration, so it differs too"


def _declared_wrong(checks: list[Check]) -> set[str]:
    """The paths whose declaration check failed: the cause found first, what their kernels show follows from it."""
    return {c.path for c in checks if c.what == "declaration" and not c.passed}


def failure_message(report: VerifyReport) -> str:
    """One line per failing (class, check, note), naming the modules, dtypes and errors.

    Where a declaration failed, that is the cause: its kernels' failures and the whole model's
    are one closing line of what follows from it, not further mistakes of their own.
    """
    wrong = _declared_wrong(report.checks)
    groups: dict[tuple[str, str, str, str], list[Check]] = {}
    follows: list[Check] = []
    for c in report.failures:
        if wrong and (c.path in wrong and c.what == "kernel" or c.path == MODEL):
            follows.append(c)
        else:
            groups.setdefault((c.cls, c.op, c.what, c.note), []).append(c)
    lines = ["patched model does not compute what the original computed:"]
    for (cls, op, what, note), checks in groups.items():
        paths = list(dict.fromkeys(c.path for c in checks))
        shown = ", ".join(paths[:4])
        where = shown if len(paths) <= 4 else f"{shown} and {len(paths) - 4} more"
        errs = {}
        for c in checks:
            if c.dtype != "-":
                errs[c.dtype] = max(errs.get(c.dtype, 0.0), c.max_abs)
        err_text = ", ".join(f"{dt} {_num(e)}" for dt, e in errs.items())
        label = what if cls == "function" or paths[0] == MODEL else f"{what} of {op}"
        line = f"  {where} ({cls}): {label} failed"
        if err_text:
            line += f" (max abs err {err_text})"
        lines.append(line + (f": {note}" if note else ""))
    if follows:
        parts = ["their kernels"] if any(c.path != MODEL for c in follows) else []
        whole = [c for c in follows if c.path == MODEL]
        if whole:
            checked = ", ".join(dict.fromkeys(c.what for c in whole))
            parts.append(f"the whole model ({checked}; max abs err {_num(max(c.max_abs for c in whole))})")
        verb = "differ" if len(parts) > 1 or not whole else "differs"
        lines.append(f"  as a result of the declaration failure above, {' and '.join(parts)} {verb} too")
    return "\n".join(lines)
