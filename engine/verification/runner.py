"""``verify``: run every check of a patched model and gather them in one report."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import torch
from torch import nn

from engine.errors import NotPatched, VerificationFailed
from engine.patching.patcher import STATE_ATTR, apply, revert
from engine.runtime.wrappers import unwrap
from engine.verification.compare import DTYPE_NAMES, move_tensors
from engine.verification.models import Alongside, Offload, compare_models, holding_device, seeded
from engine.verification.modules import verify_function, verify_module
from engine.verification.probes import capture_inputs, low_precision_dtype, probe_batch, recording, takes_labels
from engine.verification.progress import Progress, ProgressOption
from engine.verification.random_state import keeps_random_state
from engine.verification.results import MODEL, Check, VerifyReport, failure_message

__all__ = ["sample_modules", "verify"]

Modules = Literal["all", "sample"]


@keeps_random_state  # the caller's RNG (dropout masks of the training that follows) is untouched
def verify(
    model: nn.Module,
    patchset: Any = None,
    *,
    batch: Mapping[str, torch.Tensor] | None = None,
    modules: Modules = "all",
    check_model: bool = True,
    raise_on_failure: bool = True,
    offload: Offload = "auto",
    progress: ProgressOption = None,
    conditions: Any = "all",
    **apply_kwargs: Any,
) -> VerifyReport:
    """Verify a patched model (or, given ``patchset``, patch an unpatched one, verify it, and revert it).

    Every patched module is checked on the inputs it received in one real forward, in fp32
    and in the model's low-precision dtype (bf16 for an fp32 model, where cast orders
    differ); then the whole model (logits, loss, parameter gradients) in its own dtype. A
    result that is not bit-equal to the original's passes where it differs from it by at most
    ``k`` times the original's own rounding error, measured against the original evaluated
    in fp64 (:func:`engine.verification.compare.judge`). Nothing is copied but one module at
    a time; the model is left as it was (forwards, parameters, ``.grad``, the RNG state).

    Args:
        model: a transformers model (or a wrapper of one, e.g. a ``PeftModel``).
        patchset: verify this patchset on ``model``, which must not be patched: it is applied
            in place (with ``apply_kwargs``: ``device``, ``mode``, ``fused_cross_entropy``),
            verified and reverted, also when verification fails.
        batch: real inputs, e.g. a tokenizer's output (``input_ids``, ``attention_mask``,
            optionally ``labels`` with ``-100`` where no loss is taken); without ``labels``, a
            causal LM gets ``input_ids`` with padding (``attention_mask == 0``) set to ``-100``.
            Default: a random batch of token ids (:func:`probe_batch`).
        modules: ``"all"`` checks every patched module one by one; ``"sample"`` only the first,
            middle and last module of each patched class (for large models: the modules of a
            class run the same code on their own weights). Functions and the whole model are
            always checked.
        offload: where what only waits to be compared is kept (the original's gradients,
            logits and loss, the modules' recorded inputs): ``"auto"`` keeps it on the host
            when the model is on an accelerator (the device then needs little more than a
            training step), where it is on a CPU; ``"host"``, ``"none"`` (the model's device)
            or a device of this machine (:func:`engine.verification.models.holding_device`); anything
            else is an :class:`InvalidArgument` naming ``offload``, the values and the devices present.
        progress: modules checked out of the total (and the whole model) as a tqdm bar on stderr,
            shown once the work takes 2 s: ``None`` where stderr is a terminal, ``True``, ``False``, or
            ``fn(done, total, what)`` (:mod:`engine.verification.progress`).
        conditions: the conditions of use (``engine/_data/conditions.yaml``: other lengths, padding, ``-100``
            labels, ``num_items_in_batch``, eval, ``no_grad``, bf16/fp16/autocast, repeated calls, an optimizer
            step, decoding with the cache, gradient checkpointing, another attention implementation) the whole
            model is also judged under, each against the original under the same condition: ``"all"`` (default:
            every one that applies), ``"budget"`` (in order, while their estimated time stays within the table's
            ``budget_s``: what ``apply``'s self-verification and zero configuration run), None, or names. The report
            lists which ran and why each other did not (``report.conditions``, ``report.conditions_not_run``).

    Raises:
        VerificationFailed: on any failed check (unless ``raise_on_failure=False``); the
            message names each failing module path and class, the declared settings, and
            the alternative settings that would have matched. ``exc.report`` has every check.
        ValueError: ``modules`` is unknown, or ``batch`` scores no token (every label ``-100``).
        TypeError: ``batch`` is not a mapping.

    Example:
        >>> enc = tokenizer(texts, return_tensors="pt", padding=True)          # doctest: +SKIP
        >>> engine.verify(model, "gemma3_text", batch=dict(enc), modules="sample")  # doctest: +SKIP
    """
    model = unwrap(model)
    if modules not in ("all", "sample"):
        raise ValueError(f"verify(modules={modules!r}): expected 'all' (every patched module) or 'sample' "
                         "(first, middle and last of each patched class)")
    holding_device(model, offload)  # a bad offload is an InvalidArgument before anything changes
    if patchset is not None and STATE_ATTR not in model.__dict__:
        apply(model, patchset, **apply_kwargs)
        try:
            return verify(model, batch=batch, modules=modules, check_model=check_model,
                          raise_on_failure=raise_on_failure, offload=offload, progress=progress,
                          conditions=conditions)
        finally:
            revert(model)  # also on failure: the model is exactly as it was
    state = model.__dict__.get(STATE_ATTR)
    if state is None:
        raise NotPatched(
            f"{type(model).__name__} is not patched, so there is nothing to verify; call "
            "engine.apply(model, patchset) first, or pass the patchset: engine.verify(model, 'qwen3') "
            "patches it, verifies, and reverts it"
        )
    started = time.perf_counter()
    decisions = [d for d in state.report.decisions if d.action == "patch"]
    checked = decisions if modules == "all" else sample_modules(decisions)
    batch = prepare_batch(model, batch)
    low = low_precision_dtype(model)
    model_dtype = next(model.parameters()).dtype
    report = VerifyReport(
        model_dtype=DTYPE_NAMES.get(model_dtype, str(model_dtype)), dtypes=("fp32", DTYPE_NAMES[low]),
        sampled=len(decisions) - len(checked),
    )
    held = holding_device(model, offload)
    named = dict(model.named_modules())
    containers = _containers(checked)
    captured: dict[str, Any] = {}
    per_path: dict[str, list[Check]] = {}
    shown = Progress(len(checked) + int(check_model), progress)

    exemplars: dict[tuple[str, str], tuple[str, Any]] = {}  # one reached module's inputs per (class, op)

    def check_captured() -> None:  # each check as soon as its inputs are there, which are then released
        for d in checked:
            if d.path in captured and d.path not in per_path:
                inputs = captured.pop(d.path)
                if d.site is None:
                    exemplars.setdefault((d.cls, d.op, _shapes(named[d.path])), (d.path, inputs))
                per_path[d.path] = _check_one(d, inputs, model, named, containers, low)
                shown.step(d.path)

    model_checks: list[Check] = []
    if check_model:
        # The modules' and functions' inputs are recorded in the original's run (a function's router
        # is called there too) and checked right after it, their inputs released before the patched
        # run, the peak. The patched run must still call each function itself (a module patch that
        # bypasses it leaves its patch a no-op): there its router notes the call, copying nothing,
        # and records the inputs of one the original did not reach. What neither reaches gets a
        # capturing forward of its own below.
        by_router = [d for d in checked if d.site is not None]
        called: dict[str, Any] = {}

        @contextlib.contextmanager
        def during_patched() -> Iterator[None]:
            with recording(model, by_router, called, held, inputs=False), \
                    recording(model, [d for d in by_router if d.path not in per_path], captured, held):
                yield

        alongside = Alongside(during_original=lambda: recording(model, checked, captured, held),
                              after_original=check_captured, during_patched=during_patched)
        crashed = False
        probe_started = time.perf_counter()
        try:
            model_checks = compare_models(model, batch, offload=held, alongside=alongside)
        except (RuntimeError, TypeError, ValueError) as exc:
            crashed = True
            # a module already found computing something else (another dtype, another shape) can make the patched
            # model fail to run at all: that is the same failure's consequence, said as such, not a raw traceback
            check_captured()
            if not any(not c.passed for checks in per_path.values() for c in checks) or _out_of_memory(exc):
                raise
            model_checks = [Check(MODEL + " logits", type(unwrap(model)).__name__, "-", "logits", "-", float("inf"),
                                  float("inf"), False, f"the patched model could not run ({type(exc).__name__}: "
                                  f"{str(exc)[:300]}), as a result of the failure(s) above")]
        check_captured()
        shown.step("the whole model")
        for d in by_router if not crashed else ():  # a patched run that stopped early called what it reached
            if d.path in per_path and d.path not in called:
                per_path[d.path] = [Check(d.path, "function", d.op, "called", "-", 0.0, 0.0, False,
                                          _NOT_CALLED_PATCHED, d.kernel or "-")]
    rest = [d for d in checked if d.path not in per_path]
    if rest:
        with seeded(model):
            captured.update(capture_inputs(model, rest, batch, held))
        check_captured()
    for d in checked:
        if d.path not in per_path and d.site is None and (d.cls, d.op, _shapes(named[d.path])) in exemplars:
            per_path[d.path] = _check_unreached(d, exemplars[(d.cls, d.op, _shapes(named[d.path]))], model, named,
                                                containers, low)
    for d in checked:
        if d.path in per_path:
            report.checks.extend(per_path[d.path])
        else:
            cls = d.cls if d.site is None else "function"
            report.checks.append(Check(d.path, cls, d.op, "called", "-", 0.0, 0.0, False, _NOT_CALLED, d.kernel or "-"))
    report.checks.extend(model_checks)
    if check_model and conditions is not None and not crashed:
        report.checks.extend(_under_conditions(model, batch, held, conditions, time.perf_counter() - probe_started,
                                               report, shown))
    report.seconds = round(time.perf_counter() - started, 2)
    shown.close()
    if raise_on_failure and not report.passed:
        error = VerificationFailed(failure_message(report))
        error.report = report  # type: ignore[attr-defined]
        raise error
    return report


def _under_conditions(model: nn.Module, batch: dict[str, Any], held: torch.device, names: Any, probe_seconds: float,
                      report: VerifyReport, shown: Progress) -> list[Check]:
    """The whole model under each chosen condition of use (:mod:`engine.verification.conditions`), its checks named
    for it; which ran and why each other did not go into ``report``."""
    from engine.verification.conditions import budget_seconds, chosen, declared, label_checks
    from engine.verification.scenario import Scenario

    wanted, report.conditions_not_run = chosen(model, names, probe_seconds)
    budget = budget_seconds() if declared(names) == "budget" else None
    checks: list[Check] = []
    cls = type(model).__name__
    started = time.perf_counter()
    shown.grow(len(wanted))
    for c in wanted:
        shown.step(f"under {c.name}")
        spent = time.perf_counter() - started
        if budget is not None and spent + c.cost * probe_seconds > budget:  # the estimate was low: time decides
            report.conditions_not_run[c.name] = (f"over the {budget:g} s budget of apply's check ({spent:.1f} s spent "
                                                 "on the conditions before it): engine.verify(model) runs it")
            continue
        scenario = Scenario(c)
        try:
            found = compare_models(model, scenario.batch(model, batch), offload=held, scenario=scenario)
            state = scenario.state_check(cls)
            found += [state] if state is not None else []
            malformed = _original_malformed(model, batch, c) if not all(x.passed for x in found) else ""
            if malformed:
                report.conditions_not_run[c.name] = f"the original model's own output is malformed under it ({malformed})"
                continue
        except Exception as exc:
            if _out_of_memory(exc):
                raise
            cause = _original_raises(model, batch, c)
            if cause:
                report.conditions_not_run[c.name] = f"the original model raises under it too ({cause})"
                continue
            text = " ".join(str(exc).split())[:300]
            found = [Check(MODEL, cls, "-", "forward", "-", float("inf"), float("inf"), False,
                           f"the patched model raised {type(exc).__name__}: {text}")]
        checks += label_checks(found, c)
        report.conditions.append(c.name)
    return checks


@contextlib.contextmanager
def _as_original(model: nn.Module) -> Iterator[None]:
    """The unpatched forwards, with the caller's gradients set aside and put back after (a run of the original
    under a condition, asked after the patched model's check)."""
    from engine.patching.patcher import original_forwards

    saved = [(p, p.grad) for p in model.parameters()]
    for p, _ in saved:
        p.grad = None
    try:
        with original_forwards(model):
            yield
    finally:
        for p, grad in saved:
            p.grad = grad


def _original_malformed(model: nn.Module, batch: dict[str, Any], c: Any) -> str:
    """Why the original model's logits under condition ``c`` do not fit its input ("" where they do).

    Why: a release's own bug is not the patch's. FalconH1 before transformers 5.24 returns logits for two
    positions from a one-token batch of two (its gated norm broadcasts the batch against the sequence); the
    patched model's kernel returns one, and every check under ``length 1`` then differs. The condition is
    reported as not run, with the original's shape, rather than blamed on the patch. Asked only after a check
    failed, so a passing condition costs nothing more; a patch cannot make the *original* misbehave, so an
    adversarial patch is not excused by it.
    """
    from engine.verification.models import without_labels
    from engine.verification.scenario import Scenario

    scenario = Scenario(c)
    if scenario.condition.generate:
        return ""
    given = scenario.batch(model, batch)
    ids = given.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return ""
    try:
        with _as_original(model):
            out = without_labels(model, given, scenario=scenario)
    except Exception:  # noqa: BLE001  (a failing original is _original_raises's to say)
        return ""
    logits = out.get("logits") if hasattr(out, "get") else None
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or tuple(logits.shape[:2]) == tuple(ids.shape):
        return ""
    return (f"logits for {tuple(logits.shape[:2])} (batch, positions) from input_ids of {tuple(ids.shape)}, "
            "unpatched; a bug of this transformers release, not the patch's")


def _original_raises(model: nn.Module, batch: dict[str, Any], c: Any) -> str:
    """What the original model raises under condition ``c`` ("" where it runs)."""
    from engine.verification.models import run
    from engine.verification.scenario import Scenario

    scenario = Scenario(c)
    try:
        with _as_original(model):
            run(model, scenario.batch(model, batch), scenario=scenario)
    except Exception as exc:  # noqa: BLE001  (any failure of the original: the condition does not apply)
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
    return ""


def _check_one(d: Any, inputs: Any, model: nn.Module, named: dict[str, nn.Module], containers: set[str],
               low: torch.dtype) -> list[Check]:
    """The module or function check of one decision, on the inputs recorded for it."""
    args, kwargs = move_tensors(inputs, next(model.parameters()).device)
    if d.site is None:
        return verify_module(d, named[d.path], args, kwargs, low, within=model if d.path in containers else None)
    return verify_function(d, args, kwargs, low)


def _shapes(module: nn.Module) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """A module's parameter shapes: a reached module whose inputs fit an unreached one has the same."""
    return tuple((name, tuple(p.shape)) for name, p in module.named_parameters())


def _check_unreached(d: Any, exemplar: tuple[str, Any], model: nn.Module, named: dict[str, nn.Module],
                     containers: set[str], low: torch.dtype) -> list[Check]:
    """A patched module the forward never reached, checked on the inputs a reached one of its class got.

    Why: one model class can hold modules that one forward cannot reach: the cross-attention norms
    of an encoder-decoder's decoder (BART, Whisper, Marian) run only with encoder states, which its
    causal-LM class never passes. Called on another instance's recorded inputs it is checked as
    strictly as one that ran (declaration and kernel, on its own weights); the ``called`` row says
    so. The inputs are those of a reached module with the same parameter shapes (an audio tower's
    norms of another width than the text layers' are not fed the text layers' inputs); with none,
    or where the inputs still do not fit it, it stays a failure: nothing verified it.
    """
    source, inputs = exemplar
    module = named[d.path]
    try:
        checks = _check_one(d, inputs, model, named, containers, low)
    except Exception as exc:  # noqa: BLE001  (inputs of another shape: not verified, and it says why)
        return [Check(d.path, d.cls, d.op, "called", "-", 0.0, 0.0, False,
                      f"{_NOT_CALLED} (called on the inputs of {source}, a {type(module).__name__} the forward "
                      f"reached, it raised {type(exc).__name__}: {str(exc)[:200]})", d.kernel or "-")]
    note = (f"not reached by the verification forward (as an encoder-decoder's cross-attention modules without "
            f"encoder states); checked on the inputs recorded for {source}, a reached module of its class")
    return [Check(d.path, d.cls, d.op, "called", "-", 0.0, 0.0, True, note, d.kernel or "-"), *checks]


def sample_modules(decisions: Sequence[Any]) -> list[Any]:
    """The first, middle and last patched module of each class (and op); every function patch.

    Why these three: the modules of one class run the same forward on their own weights, and
    trained weights differ most between the first and the last layers (the middle one stands
    for the rest).
    """
    groups: dict[tuple[str, str], list[Any]] = {}
    for d in decisions:
        if d.site is None:
            groups.setdefault((d.cls, d.op), []).append(d)
    keep = set()
    for group in groups.values():
        keep.update(id(group[i]) for i in {0, len(group) // 2, len(group) - 1})
    return [d for d in decisions if d.site is not None or id(d) in keep]


def prepare_batch(model: nn.Module, batch: Mapping[str, torch.Tensor] | None) -> dict[str, Any]:
    """The batch to verify on: the given one on the model's device (with labels for a causal LM), or a probe.

    A tokenizer's ``BatchEncoding`` is a mapping and works as it is. Without ``labels``, a
    model that takes them gets ``input_ids`` as labels with padding (``attention_mask == 0``)
    set to ``-100``, as a causal-LM data collator makes them.
    """
    if batch is None:
        return probe_batch(model)
    if not isinstance(batch, Mapping):
        raise TypeError(f"verify(batch=...) takes a mapping of model inputs (a tokenizer's output, or "
                         f"{{'input_ids': ..., 'attention_mask': ..., 'labels': ...}}), not {type(batch).__name__}")
    device = next(model.parameters()).device
    out = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    ids = out.get("input_ids")
    if "labels" not in out and isinstance(ids, torch.Tensor) and takes_labels(model):
        mask = out.get("attention_mask")
        out["labels"] = ids.masked_fill(mask == 0, -100) if isinstance(mask, torch.Tensor) else ids.clone()
    labels = out.get("labels")
    if isinstance(labels, torch.Tensor) and labels.numel() and not bool((labels[..., 1:] != -100).any()):
        raise ValueError("verify(batch=...): every label after the first position is -100, so no token is scored: "
                         "the loss and its gradients would say nothing. Pass labels for at least one token")
    return out


def _containers(decisions: Sequence[Any]) -> set[str]:
    """Paths of patched modules that hold another patched module (the fused head's target: the model)."""
    paths = [d.path for d in decisions if d.site is None]
    return {p for p in paths if any(q != p and (p == "" or q.startswith(p + ".")) for q in paths)} | (
        {""} if "" in paths else set())


_NOT_CALLED_PATCHED = (
    "called by the original model but never by the patched one (a patched forward bypasses it), so this "
    "patch changes nothing for this model: remove it, or the patch that replaces its caller"
)
_NOT_CALLED = (
    "never called during the verification forward, so this patch changes nothing for this model: "
    "remove it, or check that the config exercises it"
)


def _out_of_memory(exc: BaseException) -> bool:
    """Out of memory is never a verdict: it propagates as it is."""
    return "out of memory" in str(exc).lower()
