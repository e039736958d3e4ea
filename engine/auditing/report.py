"""An audit's findings: one row per change a patch made, the whole-model checks, and a verdict.

Pure data and formatting. The verdicts, strongest first:

* ``error``: the patch itself raised (the stack's error, quoted); nothing was judged;
* ``unchanged``: no change found that this model runs (a process-wide change it cannot reach, such as
  another family's function, is listed and put back) *and* the whole model's logits, loss and every
  gradient are bit-identical to the original's (the whole model is always judged);
* ``differs``: a module (forward or backward), function or whole-model value is beyond the original's
  own rounding error, or computes another declaration than the original (named), or rounds more than
  it; or the whole model is not bit-identical while every change found is (a change nothing names);
* ``unchecked``: something the patch changed could not be run (a kernel that needs a device or an
  op nothing here emulates), and nothing differs;
* ``passes``: everything the patch changed computes the original's numbers (bit-equal, or
  within ``k`` times the original's own rounding error, as ``verify`` judges them).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from engine.planning.report import format_table
from engine.verification.results import Check

__all__ = ["AuditReport", "Row", "check_key", "checks_text"]

def check_key(what: str) -> str:
    """A whole-model check's key: ``logits`` for ``logits (no labels)``, ``grads [left padding]`` under a condition
    (:mod:`engine.auditing.conditions`)."""
    head = what.split(" ")[0]
    return f"{head} {what[what.rindex('['):]}" if what.endswith("]") and "[" in what else head


def checks_text(whats: list[str]) -> str:
    """Whole-model checks named once each: ``logits, loss, grads``, and where conditions are among them,
    ``logits, grads (on the probe and with length 17, left padding)`` or ``grads (with length 100)``."""
    heads = list(dict.fromkeys(w.split(" ")[0] for w in whats))
    under = list(dict.fromkeys(w[w.rindex("[") + 1:-1] for w in whats if w.endswith("]") and "[" in w))
    if not under:
        return ", ".join(heads)
    probe = any(not w.endswith("]") for w in whats)
    return f"{', '.join(heads)} ({'on the probe and ' if probe else ''}with {', '.join(under)})"


#: Readings that decide where an op rounds (documented formulas, not rounding): see :meth:`AuditReport._on_reading`.
ROUNDING_READINGS = ("the torch_npu emulator",)

_ORDER = ("error", "differs", "unchecked", "passes", "unchanged")


@dataclass
class Row:
    """One change and what it computes.

    ``result``: ``same`` (bit-equal), ``passes``, ``differs``, ``unchecked``, ``whole model`` (judged
    only by the whole-model checks) or ``not in this model`` (a process-wide change this model
    does not reach). ``ratio``: its largest difference over the original's own error vs fp64.
    """

    path: str
    cls: str
    change: str
    detail: str
    result: str
    max_abs: float | None = None
    ratio: float | None = None
    note: str = ""
    explanation: str = ""
    evidence: str = ""   # "exact arithmetic" (another declaration, to the ulp), or the reading it rests on
    #: its forward is bit-equal and it passes by its backward (not bit-equal, within the rounding error) only
    forward_same: bool = False
    #: its backward check saw it write into the gradient it was given (:mod:`engine.auditing.shared_gradients`)
    writes_gradient: bool = False


@dataclass
class AuditReport:
    """Everything one audit found about one patch on one model."""

    patch: str
    model: str
    model_type: str
    dtype: str
    environment: list[str] = field(default_factory=list)
    error: str | None = None
    rows: list[Row] = field(default_factory=list)
    model_checks: list[Check] = field(default_factory=list)
    model_ratios: dict[str, float] = field(default_factory=dict)
    model_problem: str | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    #: What the patch's kernels ran on where they cannot run natively here ("Triton's interpreter", "the
    #: torch_npu emulator"): a finding that rests on it is labelled and kept apart from exact arithmetic.
    reading: str = ""
    #: Where the whole model is not bit-identical and every change found is: with all of them put back on the
    #: patched copy, the whole model is bit-identical (True: they account for it), still is not (False), or it
    #: could not be shown (None: not tried, or a change found cannot be put back).
    accounted: bool | None = None

    def _on_reading(self, row: Row) -> bool:
        """Whether a finding rests on the reading: a number of a kernel it ran, not another declaration reproduced
        (Triton's interpreter runs a kernel's own casts; the NPU emulator rounds each op once, a guess the NPU's
        documentation leaves open, so a finding in where it rounds rests on that reading too)."""
        if not self.reading or row.evidence in ("exact arithmetic", "in-place gradient", "in-place input"):
            return False  # another declaration to the ulp, or a write into a shared buffer: no rounding reading
        return row.evidence != "rounding order" or self.reading in ROUNDING_READINGS

    @property
    def reading_only(self) -> bool:
        """It differs, and only by what rests on an interpreter's or emulator's reading (no exact-arithmetic finding).

        A module row must rest on the reading: a whole-model value that differs while no module does (Liger's
        granite logits 7.6e5x, a gradient written in place) is not located, so nothing says a reading explains it.
        """
        differing = [r for r in self.rows if r.result == "differs"]
        return (self.verdict == "differs" and bool(self.reading) and bool(differing)
                and all(self._on_reading(r) for r in differing))

    @property
    def judged(self) -> list[Row]:
        return [r for r in self.rows if r.result in ("same", "passes", "differs", "unchecked")]

    @property
    def model_identical(self) -> bool:
        """Logits, loss and every gradient bit-identical to the original's (the whole model was judged)."""
        return bool(self.model_checks) and all(c.passed and c.max_abs == 0 for c in self.model_checks)

    @property
    def unseen(self) -> bool:
        """The whole model computes otherwise while every change found is bit-equal (or none was found), and
        putting every change found back does not show that they account for it: never a pass.

        A change whose forward is bit-equal and whose backward is not (within the rounding error: another
        kernel's order of a sum) explains gradients that are not bit-identical, never logits or a loss. An exact
        change that adds a node to autograd's graph (a norm's input cloned) makes autograd sum the same gradients
        in another order: put back, the whole model is bit-identical (:attr:`accounted`), so nothing unseen.
        """
        return self._unexplained and self.accounted is not True

    @property
    def _unexplained(self) -> bool:
        seen = [r for r in self.rows if r.result != "not in this model"]
        if self.model_problem is not None or self.model_identical:
            return False
        forward_moved = any(c.max_abs != 0 for c in self.model_checks if not c.what.startswith("grads"))
        return all(r.result == "same" or (forward_moved and r.forward_same) for r in seen)

    @property
    def verdict(self) -> str:
        if self.error is not None:
            return "error"
        if any(r.result == "differs" for r in self.rows) or any(not c.passed for c in self.model_checks):
            return "differs"
        if self.model_problem is not None or any(r.result == "unchecked" for r in self.rows):
            return "unchecked"
        if self.unseen:
            return "differs"
        if all(r.result == "not in this model" for r in self.rows):  # nothing found, and bit-identical
            return "unchanged"
        return "passes"

    @property
    def worst_ratio(self) -> float | None:
        """The largest difference anywhere over the original's own error there (None: nothing was compared)."""
        values = [r.ratio for r in self.rows if r.ratio is not None] + list(self.model_ratios.values())
        return max(values) if values else None

    @property
    def worst_difference(self) -> float | None:
        """The largest ratio among what differs (rows and failed whole-model checks); else :attr:`worst_ratio`.

        Why apart: a whole-model value can pass its own rule (a bf16 loss, judged by its tokens' noise)
        at a ratio above a module's that differs by declaration; a picture of what differs shows the latter.
        """
        if self.verdict != "differs":
            return self.worst_ratio
        values = [r.ratio for r in self.rows if r.result == "differs" and r.ratio is not None]
        values += [self.model_ratios.get(check_key(c.what), float("inf")) for c in self.model_checks if not c.passed]
        return max(values) if values else None

    def summary(self) -> str:
        """One line: the verdict and its reason."""
        head = f"{self.patch} on {self.model_type} ({self.dtype}): {self.verdict}"
        if self.verdict == "error":
            return f"{head}: the patch raised {self.error}"
        if self.verdict == "unchanged":
            elsewhere = f" ({len(self.rows)} process-wide changes this model does not reach)" if self.rows else ""
            return (f"{head}: the patch changed nothing this model runs{elsewhere}: logits, loss and every gradient "
                    "are bit-identical to the original's")
        bad = [r for r in self.rows if r.result in ("differs", "unchecked")]
        failed = [c for c in self.model_checks if not c.passed]
        grouped = _grouped(bad)
        parts = [_finding(r) for r in grouped if not self._on_reading(r) or r.result != "differs"]
        apart = [_finding(r) for r in grouped if self._on_reading(r) and r.result == "differs"]
        # a row found by putting it back ("put back") differs by the whole model's checks, not on the probe's inputs
        on_probe = any(r.evidence != "put back" for r in bad)
        (apart if self.reading_only else parts).extend(_failed(failed, self.model_checks, on_probe))
        if apart:
            parts.append(f"on {self.reading}'s reading only (not exact arithmetic; a device may differ): "
                         + "; ".join(apart))
        worst_abs = max((c.max_abs for c in self.model_checks), default=0.0)
        moved = ", ".join(check_key(c.what) for c in self.model_checks if c.max_abs != 0)
        if self.unseen and not failed:
            head_note = (f"the whole model's {moved} are not the original's (max abs {worst_abs:.2g}, within its "
                         "rounding error)")
            if not [r for r in self.rows if r.result != "not in this model"]:
                parts.append(f"{head_note} and no change was found: a change the detector cannot see")
            elif self.accounted is False:
                parts.append(f"{head_note}, and still are with every change found put back: a change the detector "
                             "cannot see")
            else:
                parts.append(f"{head_note}; the changes found are bit-equal on their own, and not all of them can be "
                             "put back to show whether they account for it")
        elif self.accounted and self._unexplained and not failed:
            parts.append(f"the whole model's {moved} are not bit-identical to the original's (max abs "
                         f"{worst_abs:.2g}, within its rounding error) and are with the changes found put back: they "
                         "account for it (bit-equal on their own, they change how the model adds up the same terms: "
                         "autograd summing the gradients of a tensor used twice in another order, for one)")
        if self.model_problem:
            parts.append(f"whole model unchecked: {self.model_problem}")
        worst = self.worst_difference
        tail = f" (worst {_ratio(worst)} the original's own error)" if worst else ""
        return head + (": " + "; ".join(parts) if parts else "") + tail

    def table(self, *, detail: bool = False) -> str:
        rows = self.rows if detail else _grouped(self.rows)
        lines = [(r.path or "<model>", r.cls, _change(r), r.result, _num(r.max_abs), _ratio(r.ratio),
                  r.explanation or r.note or (r.detail if r.change == "process-wide" else "")) for r in rows]
        lines += [(c.path, c.cls, "-", "same" if c.passed and c.max_abs == 0 else ("passes" if c.passed else "differs"),
                   _num(c.max_abs), _ratio(self.model_ratios.get(check_key(c.what))), f"{c.what}: {c.note}".strip(": "))
                  for c in self.model_checks]
        if self.model_problem:
            lines.append(("<model>", self.model, "-", "unchecked", "-", "-", self.model_problem))
        return format_table(("module", "class", "what changed", "result", "max abs", "x own error",
                             "what it computes / note"), lines)

    def __str__(self) -> str:
        out = [self.summary()]
        out += [f"  {e}" for e in self.environment]
        if self.verdict not in ("error", "unchanged"):
            out += ["", self.table()]
        if self.seconds:
            out.append("time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items()))
        return "\n".join(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "patch": self.patch, "model": self.model, "model_type": self.model_type, "dtype": self.dtype,
            "verdict": self.verdict, "summary": self.summary(), "environment": self.environment, "error": self.error,
            "worst_ratio": _finite(self.worst_ratio), "rows": [_clean(asdict(r)) for r in self.rows],
            "model_checks": [_clean(asdict(c)) for c in self.model_checks], "model_problem": self.model_problem,
            "seconds": self.seconds, "reading": self.reading, "reading_only": self.reading_only,
            "accounted": self.accounted,
        }


def _failed(failed: list[Check], checks: list[Check], rows_fail: bool = False) -> list[str]:
    """``logits differs`` for the probe's checks; ``logits, loss differ with left padding`` for a condition's, and
    where the probe's own checks pass, that they do: the condition is what shows it. ``rows_fail``: a change found
    differs (or is unchecked) on the inputs the probe recorded, so the probe does not pass: only its whole-model
    checks do (Liger's OLMo 2 in bf16: its norms' cast order differs on the probe, its loss under length 1)."""
    out = [f"{c.what} differs" for c in failed if not c.what.endswith("]")]
    heads: dict[str, list[str]] = {}
    for c in failed:
        if c.what.endswith("]"):
            heads.setdefault(c.what[c.what.rindex("[") + 1:-1], []).append(c.what.split(" ")[0])
    under: dict[tuple[str, ...], list[str]] = {}  # conditions that fail the same checks, named together
    for name, whats in heads.items():
        under.setdefault(tuple(whats), []).append(name)
    probe = all(c.passed for c in checks if not c.what.endswith("]"))
    out += [f"{', '.join(whats)} differ{'s' if len(whats) == 1 else ''} with {', '.join(names)}"
            for whats, names in under.items()]
    if under and probe:
        out.append("the probe's logits, loss and grads (16 tokens, no padding, no -100 label) pass" if rows_fail else
                   "the probe (16 tokens, no padding, no -100 label) passes")
    return out


def _finding(r: Row) -> str:
    who = r.cls if r.cls not in ("-", "function", "config") else r.path
    ratio = f" ({_ratio(r.ratio)})" if r.ratio else ""
    return f"{who} {r.result}{ratio}" + (f": {r.explanation or r.note}" if r.explanation or r.note else "")


def worst_verdict(verdicts: list[str]) -> str:
    return min(verdicts, key=_ORDER.index) if verdicts else "unchanged"


def _grouped(rows: list[Row]) -> list[Row]:
    """Rows of one class, change, result and explanation as one (the worst numbers, the first path and a count)."""
    groups: dict[tuple[str, str, str, str, str], list[Row]] = {}
    elsewhere = [r for r in rows if r.result == "not in this model"]
    rows = [r for r in rows if r.result != "not in this model"]
    for r in rows:
        groups.setdefault((r.cls, r.change, r.result, r.explanation or r.note[:60],
                           r.detail if r.cls in ("-", "function") else ""), []).append(r)
    out = []
    for members in groups.values():
        first = members[0]
        path = first.path if len(members) == 1 else f"{first.path} and {len(members) - 1} more"
        out.append(Row(path, first.cls, first.change, first.detail, first.result,
                       _max([r.max_abs for r in members]), _max([r.ratio for r in members]), first.note,
                       first.explanation, first.evidence))
    if elsewhere:
        out.append(Row(f"{len(elsewhere)} process-wide change{'s' if len(elsewhere) > 1 else ''}", "-", "process-wide",
                       "", "not in this model", note="other families' classes and functions, class names for models "
                       "built later (--detail lists each); all put back after the audit"))
    return out


#: Changes whose detail is shown whole in the table (not shortened to the last dotted name).
_SHOWN_WHOLE = frozenset({"attributes changed", "hooks added", "gradient hooks added", "requires_grad changed"})


def _change(row: Row) -> str:
    """``forward replaced: LigerRMSNorm.forward``: the kind of change and, shortened, what was put there."""
    if row.change == "process-wide":
        return "process-wide"
    if row.change.startswith("module "):
        return row.change
    if row.change in _SHOWN_WHOLE:  # short already, and the value is the finding (variance_epsilon 1e-06 -> 0.01)
        return f"{row.change}: {row.detail}" if len(row.detail) <= 60 else f"{row.change}: {row.detail[:57]}..."
    parts = row.detail.split(" -> ")[-1].split(".") if row.detail else []
    short = ".".join(parts[-2:] if len(parts) > 1 and not parts[-2].islower() else parts[-1:])
    return f"{row.change}: {short}" if short else row.change


def _max(values: list[float | None]) -> float | None:
    found = [v for v in values if v is not None]
    return max(found) if found else None


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return "0" if x == 0 else ("inf" if math.isinf(x) else f"{x:.1e}")


def _ratio(x: float | None) -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else f"{x:.2g}x"


def _finite(x: float | None) -> float | str | None:
    return "inf" if x is not None and math.isinf(x) else x


def _clean(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _finite(v) if isinstance(v, float) else v for k, v in d.items()}
