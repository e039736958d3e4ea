"""``verify``: run every check of a patched model and gather them in one report."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from engine.errors import NotPatched, VerificationFailed
from engine.patcher import STATE_ATTR, apply, revert
from engine.verification.compare import DTYPE_NAMES
from engine.verification.models import compare_models
from engine.verification.modules import verify_function, verify_module
from engine.verification.probes import capture_inputs, low_precision_dtype, probe_batch
from engine.verification.results import Check, VerifyReport, failure_message
from engine.wrappers import unwrap


def verify(
    model: nn.Module,
    patchset: Any = None,
    *,
    batch: dict[str, torch.Tensor] | None = None,
    check_model: bool = True,
    raise_on_failure: bool = True,
    **apply_kwargs: Any,
) -> VerifyReport:
    """Verify a patched model (or, given ``patchset``, a patched deep copy of an unpatched one).

    Every patched module is checked on the inputs it received in one real forward, in fp32
    and in the model's low-precision dtype (bf16 for an fp32 model, where cast orders
    differ); then the whole model (logits, loss, parameter gradients) in its own dtype.

    Raises:
        VerificationFailed: on any failed check (unless ``raise_on_failure=False``); the
            message names each failing module path and class, the declared settings, and
            the alternative settings that would have matched. ``exc.report`` has every check.
    """
    model = unwrap(model)
    if patchset is not None and STATE_ATTR not in model.__dict__:
        twin = copy.deepcopy(model)
        apply(twin, patchset, **apply_kwargs)
        try:
            return verify(twin, batch=batch, check_model=check_model, raise_on_failure=raise_on_failure)
        finally:
            revert(twin)  # releases its function routers: the copy must not keep them installed
    state = model.__dict__.get(STATE_ATTR)
    if state is None:
        raise NotPatched(
            f"{type(model).__name__} is not patched, so there is nothing to verify; call "
            "engine.apply(model, patchset) first, or pass the patchset: engine.verify(model, 'qwen3') "
            "verifies a patched copy and leaves the model as it is"
        )
    decisions = [d for d in state.report.decisions if d.action == "patch"]
    batch = batch or probe_batch(model)
    low = low_precision_dtype(model)
    model_dtype = next(model.parameters()).dtype
    report = VerifyReport(
        model_dtype=DTYPE_NAMES.get(model_dtype, str(model_dtype)), dtypes=("fp32", DTYPE_NAMES[low])
    )
    captured = capture_inputs(model, decisions, batch)
    modules = dict(model.named_modules())
    for d in decisions:
        if d.path not in captured:
            cls = d.cls if d.site is None else "function"
            report.checks.append(Check(d.path, cls, d.op, "called", "-", 0.0, 0.0, False, _NOT_CALLED, d.kernel or "-"))
            continue
        args, kwargs = captured[d.path]
        if d.site is None:
            report.checks.extend(verify_module(d, modules[d.path], args, kwargs, low))
        else:
            report.checks.extend(verify_function(d, args, kwargs, low))
    if check_model:
        report.checks.extend(compare_models(model, batch))
    if raise_on_failure and not report.passed:
        error = VerificationFailed(failure_message(report))
        error.report = report  # type: ignore[attr-defined]
        raise error
    return report


_NOT_CALLED = (
    "never called during the verification forward, so this patch changes nothing for this model: "
    "remove it, or check that the config exercises it"
)
