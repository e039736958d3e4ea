"""``audit``: judge someone else's patch of a model with the verifier, against an original measured first.

The order is the point (docs/audit.md, "Why the original cannot be contaminated"):

1. **the original, before any patch exists**: one training step of the unpatched model (logits,
   loss, every gradient), during which every module and every module-level function the
   forwards call records its inputs; then each record's output and its fp64 truth, and the
   whole model's fp64 truth (:mod:`engine.auditing.recording`, :mod:`engine.auditing.whole_model`);
2. **each patch, on a copy**: the process's watched names are recorded
   (:class:`engine.auditing.process_state.ProcessState`), the model is deep-copied and the patch
   runs on the copy; a patch that raises is reported as the stack's error;
3. **what changed** (:func:`engine.auditing.changes.find_changes`) is judged: each changed module
   and function on its recorded inputs (a module's backward too: :mod:`engine.auditing.backward`),
   and **the whole copy, always**, by the same logits, loss and gradient checks as ``verify``,
   whatever the detector found (a change it cannot see still moves those numbers); what differs is
   explained by the closest declaration we know;
4. **everything put back**: the copy is dropped (the model was never patched) and every watched
   name the patch rebound is restored, also when judging fails.
"""

from __future__ import annotations

import copy
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from engine.auditing.adapters import Adapter, resolve
from engine.auditing.backward import judge_backward
from engine.auditing.changes import find_changes, identities
from engine.auditing.conditions import Measured, condition_of, judge_conditions, measure_conditions
from engine.auditing.conditions import conditions as declared
from engine.auditing.instance_undo import found_changes_account, locate_instance_changes, undoers_of
from engine.auditing.judging import judge_change, judge_registry
from engine.auditing.process_state import ProcessState
from engine.auditing.put_back import locate_by_putting_back, undoers
from engine.auditing.recording import Recorded, containers, measure, recording
from engine.auditing.report import AuditReport, check_key
from engine.auditing.shared_gradients import locate_shared_gradient
from engine.auditing.written_inputs import locate_written_inputs
from engine.auditing.whole_model import OriginalRun, judge_patched, measure_original
from engine.runtime.hub_functions import torch_body
from engine.runtime.wrappers import unwrap
from engine.verification.compare import DTYPE_NAMES
from engine.verification.models import holding_device
from engine.verification.random_state import keeps_random_state
from engine.verification.runner import prepare_batch

__all__ = ["Original", "audit", "audit_many", "measure_first"]

Patch = str | Callable[[nn.Module], Any] | Adapter
#: ``fn(done, total, what)`` after each part (as :data:`engine.verification.progress.ProgressOption`'s callable): the
#: original's measurement counts its probe, its modules and each declared condition; the patches count one each, and
#: a call that repeats ``done`` says where the patch being judged has come (a command's progress, minutes long).
AuditProgress = Callable[[int, int, str], Any] | None


def _silent(done: int, total: int, what: str) -> None:
    return None


class Original:
    """The unpatched model's numbers, measured once, against which any number of patches are judged."""

    def __init__(self, model: nn.Module, batch: dict[str, Any], held: torch.device, seconds: float,
                 whole: OriginalRun, records: dict[Any, Recorded], functions: dict[tuple[str, str], Any]):
        self.model, self.batch, self.held, self.seconds = model, batch, held, seconds
        self.whole, self.records, self.functions = whole, records, functions
        self.phases: dict[str, float] = {}
        self.conditions: list[Measured] = []  # the original under each condition of use (conditions.yaml)


@keeps_random_state
def measure_first(model: nn.Module, batch: dict[str, Any] | None = None, *, offload: Any = "auto",
                  conditions: Any = "default", progress: AuditProgress = None) -> Original:
    """Step 1 of an audit (see the module docstring): everything the original computes, before any patch."""
    from engine.scaffolding.capture import model_functions

    started = time.perf_counter()
    model = unwrap(model)
    batch = prepare_batch(model, batch)
    if "use_cache" in inspect.signature(model.forward).parameters:
        batch.setdefault("use_cache", False)  # a cache the layers write into would make their recorded inputs stale
    held = holding_device(model, offload)
    paths = {p for p, _ in model.named_modules()} - containers(model)
    functions = model_functions(model)
    records: dict[Any, Recorded] = {}
    whole = measure_original(model, batch, held, recording(model, paths, functions, records, held))
    wanted, say = declared(conditions), progress or _silent
    say(1, 2 + len(wanted), "the original: the model and its fp64 truth")
    modules_started = time.perf_counter()
    measure(model, functions, records)
    say(2, 2 + len(wanted), f"the original: {len(records)} modules and functions and their fp64 truth")
    conditions_started = time.perf_counter()
    under = []
    for i, condition in enumerate(wanted, 3):
        under += measure_conditions(model, held, [condition], batch)
        ran = bool(under) and under[-1].condition == condition
        say(i, 2 + len(wanted), f"the original under {condition.name}" + ("" if ran else ": does not apply"))
    original = Original(model, batch, held, time.perf_counter() - started, whole, records, functions)
    original.conditions = under
    original.phases = {"model and its truth": round(modules_started - started, 1),
                       "modules and their truth": round(conditions_started - modules_started, 1)}
    if under:
        names = ", ".join(m.condition.name for m in under)
        original.phases[f"conditions ({names})"] = round(time.perf_counter() - conditions_started, 1)
    return original


def audit(model: nn.Module, patch: Patch, *, batch: dict[str, Any] | None = None, offload: Any = "auto",
          conditions: Any = "default") -> AuditReport:
    """Judge ``patch`` (someone else's) on ``model`` with the verifier; the model and the process are left as they were.

    Args:
        model: a transformers model (or a wrapper of one). Never patched itself: the patch runs on
            a deep copy (one more model in memory), and every module-level name or class attribute
            it rebinds is put back afterwards.
        patch: ``fn(model)`` patching in place (Liger's ``model=`` form), ``"MODULE:FUNCTION"``,
            ``"FILE.py:FUNCTION"``, a named stack (``"liger"``, ``"twinkle"``, ``"llamafactory-v1"``,
            ``"hf-kernels"``), ``"patchset:NAME"`` (ours, judged the same way), or an :class:`Adapter`.
        batch: real inputs, as for :func:`engine.verify` (default: a probe batch of token ids).
        conditions: the conditions of use judged beside the batch (``engine/_data/conditions.yaml``): ``"default"``,
            ``"all"``, a list of names, or None for none.

    Returns:
        An :class:`AuditReport`: per change (module class swapped, forward replaced, class
        attribute or module-level function rebound) whether it computes the original's numbers,
        and where not, the declaration that explains it; the whole model's logits, loss and
        gradients; a verdict (``passes``, ``differs``, ``unchecked``, ``unchanged``, ``error``).

    Example:
        >>> report = engine.audit(model, "liger")            # doctest: +SKIP
        >>> print(report)                                      # doctest: +SKIP
    """
    return audit_many(model, [patch], batch=batch, offload=offload, conditions=conditions)[0]


def audit_many(model: nn.Module, patches: Sequence[Patch], *, batch: dict[str, Any] | None = None,
               offload: Any = "auto", original: Original | None = None,
               conditions: Any = "default", progress: AuditProgress = None) -> list[AuditReport]:
    """:func:`audit` of several patches against one measurement of the original (measured once, first); ``progress``
    is told each patch judged of the total, and where the one being judged has come."""
    model = unwrap(model)
    model_type = str(getattr(getattr(model, "config", None), "model_type", type(model).__name__))
    adapters = [resolve(p, model_type) for p in patches]
    original = original or measure_first(model, batch, offload=offload, conditions=conditions)
    say = progress or _silent
    reports = []
    for i, adapter in enumerate(adapters):
        reports.append(_judge_one(original, adapter, model_type,
                                  lambda what, i=i, name=adapter.name: say(i, len(adapters), f"{name}: {what}")))
        say(i + 1, len(adapters), f"{adapter.name}: {reports[-1].verdict}")
    return reports


@keeps_random_state
def _judge_one(original: Original, adapter: Adapter, model_type: str,
               say: Callable[[str], Any] = lambda what: None) -> AuditReport:
    model = original.model
    dtype = next(model.parameters()).dtype
    report = AuditReport(adapter.name, type(model).__name__, model_type, DTYPE_NAMES.get(dtype, str(dtype)),
                         environment=adapter.notes, seconds={"original": round(original.seconds, 2)},
                         reading=adapter.reading)
    classes = {type(m).__module__ for m in model.modules()}
    state = ProcessState(extra_modules=classes)
    started = time.perf_counter()
    patched = copy.deepcopy(model)
    copied = identities(patched)
    try:
        with adapter.environment(patched):
            try:
                with state.watching_imports():
                    adapter.apply(patched)
            except Exception as exc:  # noqa: BLE001  (the stack's own error is the finding)
                report.error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
                return report
            report.seconds["patch"] = round(time.perf_counter() - started, 2)
            say(f"patched ({report.seconds['patch']:.1f} s)")
            started = time.perf_counter()
            _judge(original, adapter, patched, state, report, copied, say)
            report.seconds["judge"] = round(time.perf_counter() - started, 2)
    finally:
        state.restore()
        del patched
    return report


def _judge(original: Original, adapter: Adapter, patched: nn.Module, state: ProcessState, report: AuditReport,
           copied: dict[str, Any], say: Callable[[str], Any] = lambda what: None) -> None:
    """Each change found, then the whole model, always: detection says where to look, never whether to judge."""
    model = original.model
    process = state.changes()
    changes = find_changes(model, patched, process, original.functions, set(original.records), copied)
    named, mine = dict(model.named_modules()), dict(patched.named_modules())
    device = next(model.parameters()).device
    namespaces = {c.where: c.after for c in process if c.kind == "function"}
    for change in changes:
        if change.judged == "function":
            key = tuple(change.path.rsplit(".", 1))
            rec = original.records.get(key)
            row = judge_change(change, rec, adapter.function(patched, namespaces[change.path]),
                               original.functions[key], device)
        elif change.judged == "through":  # the recorded caller run again: it reaches the rebound name by its globals
            via = change.via
            rec = original.records.get(via)
            caller = mine.get(via) if isinstance(via, str) else torch_body(original.functions[via])
            row = judge_change(change, rec, caller, named.get(via) if isinstance(via, str) else caller, device)
        elif change.judged == "registry":
            row = judge_registry(change, model, original.records, device)
        else:
            rec = original.records.get(change.path) if change.judged == "module" else None
            row = judge_change(change, rec, mine.get(change.path), named.get(change.path), device)
            if rec is not None and row.result in ("same", "passes") and _sampled(change, named):
                _backward(row, mine.get(change.path), named.get(change.path), rec, device, state)
        report.rows.append(row)
    say(f"{len(changes)} changes judged; the whole model next")
    try:
        checks = judge_patched(patched, original.batch, original.whole, original.held)
    except Exception as exc:  # noqa: BLE001  (a patched model that cannot run here is unchecked, never passed)
        report.model_problem = f"the patched model raised {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        return
    say("the whole model judged")
    under = []
    for measured in original.conditions:  # one at a time: each is said as it is judged
        under += judge_conditions(patched, [measured], original.held)
        say(f"the whole model judged under {measured.condition.name}")
    checks = [*checks, *under]
    report.model_checks = checks
    report.model_ratios = _model_ratios(checks)
    moving = {condition_of(c.what) for c in under if not (c.passed and c.max_abs == 0)}

    def rerun() -> list[Any]:  # the same checks again, inside a locator's context (conditions that moved only)
        again = judge_patched(patched, original.batch, original.whole, original.held)
        return [*again, *judge_conditions(patched, original.conditions, original.held, moving, under)]

    locate_shared_gradient(report.rows, checks, mine, rerun, report.model_ratios.get("grads"))
    locate_written_inputs(report.rows, checks, {c.where: c for c in process}, rerun, report.model_ratios)
    process_undo = undoers(process, model, patched)
    locate_by_putting_back(report.rows, checks, process_undo, rerun, report.model_ratios)
    found_undo = undoers_of(report.rows, model, patched)
    locate_instance_changes(report.rows, checks, found_undo, rerun, report.model_ratios)
    if report.unseen:  # every change found is bit-equal and the whole model is not: do they account for it?
        report.accounted = found_changes_account(report.rows, found_undo, process_undo, rerun)


def _sampled(change: Any, named: dict[str, nn.Module]) -> bool:
    """The first, middle and last module of each class and change get a backward check (each costs a module's
    forward and backward three times: patched, original, fp64). Hooks are checked wherever they were added: a
    backward or gradient hook shows nowhere else."""
    if change.kind in ("hooks added", "gradient hooks added"):
        return True
    same = [p for p, m in named.items() if type(m).__name__ == change.cls]
    index = same.index(change.path) if change.path in same else 0
    wanted = {0, len(same) // 2, len(same) - 1}
    return index in wanted


def _backward(row: Any, patched: Any, original: Any, rec: Any, device: torch.device, state: ProcessState) -> None:
    if not isinstance(patched, nn.Module) or not isinstance(original, nn.Module):
        return
    result = judge_backward(patched, original, rec, device, state.suspended)
    row.writes_gradient = result.writes_gradient
    if result.problem:
        row.note = (row.note + "; " if row.note else "") + result.text()
    elif result.differs:
        row.result, row.note = "differs", result.text(row.result)
        row.explanation = ""  # what the forward computes is not the finding
        row.ratio = max(row.ratio or 0.0, *result.differs.values())
        row.max_abs = max(row.max_abs or 0.0, result.max_abs)
    elif result.within and row.result == "same":
        # a bit-equal forward over a backward that rounds otherwise (another kernel's dW sum): it passes, and it is
        # a change the whole model's gradients show, so it explains them (never "a change the detector cannot see")
        row.result, row.note, row.forward_same = "passes", result.within_text(), True
        row.ratio = max(row.ratio or 0.0, *result.within.values())
        row.max_abs = max(row.max_abs or 0.0, result.max_abs)


def _model_ratios(checks: Sequence[Any]) -> dict[str, float]:
    """Each whole-model check's difference over the original's own error, read from its note (0 where bit-equal)."""
    import re

    out = {}
    for c in checks:
        what = check_key(c.what)
        if c.max_abs == 0:
            out[what] = 0.0
            continue
        found = re.search(r"= ([0-9.e+-]+|inf) ?x the original's own error", c.note)
        if found:
            out[what] = float(found.group(1))
    return out
