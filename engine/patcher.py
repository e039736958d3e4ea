"""Applying a plan to one model instance, all-or-nothing, and reverting it exactly.

Forwards are replaced on the *instances* (``module.forward = MethodType(fn, module)``),
never on the transformers class, so other models of the same class are untouched.
Function patches go through :mod:`engine.routing`. Every change is recorded before the
next one is made; if any step fails, the records made so far are undone in reverse and
the model is exactly as it was.
"""

from __future__ import annotations

import copy
import json
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import MethodType
from typing import Any

import torch
from torch import nn

from engine import routing
from engine.errors import AlreadyPatched
from engine.ops.base import ModuleOp, get_op
from engine.planner import Decision, Mode, Plan, plan
from engine.report import Report
from engine.schema import Device, Patchset
from engine.wrappers import unwrap

__all__ = ["STATE_ATTR", "applied_report", "apply", "is_patched", "revert"]

STATE_ATTR = "_patch_engine_state"


class _Missing:
    """Marks 'the instance had no forward attribute'; one object, also across deepcopy."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _Missing:
        return self

    def __repr__(self) -> str:
        return "<no instance forward>"


_MISSING = _Missing()


@dataclass
class _ForwardRecord:
    """One instance forward replaced; undo puts back exactly what was there (or nothing)."""

    module: nn.Module
    previous: Any  # the instance attribute 'forward' before, or _MISSING

    def undo(self) -> None:
        if self.previous is _MISSING:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.__dict__["forward"] = self.previous


@dataclass
class _RouterRecord:
    """One use of a function router (counted per model)."""

    namespace: str
    function: str

    def undo(self) -> None:
        routing.release(self.namespace, self.function)


def _release_routers(keys: list[tuple[str, str]]) -> None:
    for namespace, function in keys:
        routing.release(namespace, function)


@dataclass
class AppliedState:
    """What :func:`apply` did to a model; stored on the model so that revert and deepcopy work."""

    fingerprint: str
    report: Report
    records: list[Any] = field(default_factory=list)
    finalizer: weakref.finalize | None = field(default=None, compare=False, repr=False)
    owner_id: int = 0

    def watch(self, owner: nn.Module) -> None:
        """Release this model's function routers if it is garbage-collected without a revert.

        Why: a router left installed for a dead model keeps other models of the family on the
        routed path (an extra call, and a graph break under torch.compile).
        """
        keys = [(r.namespace, r.function) for r in self.records if isinstance(r, _RouterRecord)]
        self.owner_id = id(owner)
        if keys:
            self.finalizer = weakref.finalize(owner, _release_routers, keys)

    def unwatch(self) -> None:
        if self.finalizer is not None:
            self.finalizer.detach()
            self.finalizer = None

    def __deepcopy__(self, memo: dict[int, Any]) -> AppliedState:
        # A deep-copied model is a second user of each function router.
        records = copy.deepcopy(self.records, memo)
        for rec in records:
            if isinstance(rec, _RouterRecord):
                routing.acquire(rec.namespace, rec.function)
        twin = AppliedState(self.fingerprint, self.report, records)
        owner = memo.get(self.owner_id)  # the copy of the model this state belongs to
        if isinstance(owner, nn.Module):
            twin.watch(owner)
        return twin


def is_patched(model: nn.Module) -> bool:
    return STATE_ATTR in unwrap(model).__dict__


def applied_report(model: nn.Module) -> Report | None:
    state = unwrap(model).__dict__.get(STATE_ATTR)
    return state.report if state else None


def _fingerprint(patchset: Patchset, device: Device, mode: Mode) -> str:
    return json.dumps([patchset.model_dump(mode="json"), device.value, mode], sort_keys=True)


def apply(
    model: nn.Module,
    patchset: Patchset | str | dict[str, Any],
    *,
    device: str | Device | torch.device | None = None,
    mode: Mode | None = None,
) -> Report:
    """Patch ``model`` in place with ``patchset``; return what was done.

    All checks run first (see :func:`engine.plan`); the model changes only if every one
    passes, and any failure while patching restores it. Applying the same patchset twice
    patches once. Verification is not the patcher's job: :func:`engine.apply` (the facade,
    :mod:`engine.api`) runs it after this when asked to.

    Example:
        >>> report = engine.apply(model, "qwen3")     # doctest: +SKIP
        >>> engine.revert(model)                      # doctest: +SKIP

    A peft ``PeftModel`` is patched as the transformers model inside it (the state lives
    there), so wrapping before or after patching gives the same model.
    """
    model = unwrap(model)
    the_plan = plan(model, patchset, device=device, mode=mode)
    fingerprint = _fingerprint(the_plan.patchset, the_plan.device, the_plan.mode)
    state: AppliedState | None = model.__dict__.get(STATE_ATTR)
    if state is not None:
        if state.fingerprint == fingerprint:
            return state.report
        raise AlreadyPatched(
            f"{type(model).__name__} is already patched with {state.report.patchset!r}; "
            "call engine.revert(model) before applying another patchset"
        )
    actions = _prepare(model, the_plan)  # builds every kernel (imports happen here), mutates nothing
    records: list[Any] = []
    try:
        for action in actions:
            action(records)
    except BaseException:
        for rec in reversed(records):
            rec.undo()
        raise
    report = Report.from_plan(the_plan)
    state = AppliedState(fingerprint, report, records)
    state.watch(model)
    object.__setattr__(model, STATE_ATTR, state)
    return report


def revert(model: nn.Module) -> bool:
    """Restore every original forward and function of ``model``; ``False`` if it was not patched."""
    state: AppliedState | None = unwrap(model).__dict__.pop(STATE_ATTR, None)
    if state is None:
        return False
    state.unwatch()
    for rec in reversed(state.records):
        rec.undo()
    return True


def _prepare(model: nn.Module, the_plan: Plan) -> list[Callable[[list[Any]], None]]:
    """Turn the plan into mutation steps, doing all fallible preparation first."""
    modules = dict(model.named_modules())
    impls: dict[tuple[int, str], Callable[..., Any]] = {}
    steps: list[Callable[[list[Any]], None]] = []

    def impl_for(decision: Decision) -> Callable[..., Any]:
        key = (decision.patch_index, decision.provider.name)  # type: ignore[union-attr]
        if key not in impls:
            provider = decision.provider
            impl = provider.build(decision.patch)  # type: ignore[union-attr]
            if not provider.compile_safe:  # type: ignore[union-attr]
                # torch.compile of the model must not fail on a kernel dynamo cannot trace:
                # the kernel runs eagerly, as a graph break (listed in Report.compile_disabled).
                impl = torch.compiler.disable(impl, recursive=True)
            impls[key] = impl
        return impls[key]

    for decision in the_plan.patched:
        op = get_op(decision.op)
        impl = impl_for(decision)
        if isinstance(op, ModuleOp):
            module = modules[decision.path]
            forward = op.bind(module, decision.patch, impl)
            steps.append(_set_forward_step(module, forward))
        else:
            site = decision.site
            assert site is not None
            steps.append(_router_step(site.namespace, site.function))
            for caller in site.callers:
                steps.append(_route_caller_step(modules[caller], site.namespace, site.function, impl))
    return steps


def _set_forward_step(module: nn.Module, forward: Callable[..., Any]) -> Callable[[list[Any]], None]:
    def step(records: list[Any]) -> None:
        records.append(_ForwardRecord(module, module.__dict__.get("forward", _MISSING)))
        module.forward = MethodType(forward, module)

    return step


def _router_step(namespace: str, function: str) -> Callable[[list[Any]], None]:
    def step(records: list[Any]) -> None:
        routing.acquire(namespace, function)
        records.append(_RouterRecord(namespace, function))

    return step


def _route_caller_step(
    module: nn.Module, namespace: str, function: str, impl: Callable[..., Any]
) -> Callable[[list[Any]], None]:
    def step(records: list[Any]) -> None:
        router = routing.router_for(namespace, function)
        assert router is not None, "router step runs first"
        previous = module.__dict__.get("forward", _MISSING)
        inner = _unbound_forward(module, previous)
        active = router.active

        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            token = active.set(impl)
            try:
                return inner(self, *args, **kwargs)
            finally:
                active.reset(token)

        records.append(_ForwardRecord(module, previous))
        module.forward = MethodType(forward, module)

    return step


def _unbound_forward(module: nn.Module, previous: Any) -> Callable[..., Any]:
    """The forward to call as ``f(self, ...)``, without holding a bound method (deepcopy-safe)."""
    if previous is _MISSING:
        return type(module).forward
    if isinstance(previous, MethodType) and previous.__self__ is module:
        return previous.__func__
    return lambda self, *args, **kwargs: previous(*args, **kwargs)
