"""Applying a plan to one model instance, all-or-nothing, and reverting it exactly.

Forwards are replaced on the *instances* (``module.forward = PatchedForward(fn, module, ...)``, see
:mod:`engine.patching.bound_forward`), never on the transformers class, so other models of the same
class are untouched; where a library already wrapped an instance forward (accelerate hooks,
transformers' tensor parallelism) the patch goes beneath the wrapper (:mod:`engine.patching.forwards`).
Function patches go through :mod:`engine.runtime.routing`. Every change is recorded before the next
one is made; if any step fails, the records made so far are undone in reverse and the model is
exactly as it was.

Applying the patchset a model already has is never an error: with the same kernels it is a no-op;
when the mode or device now needs other kernels (inference kernels without a backward, then
``model.train()``), or the fused head is switched on, off or re-set (``fused_cross_entropy=``, an
option of the patchset, not another one), the model is re-planned and re-patched. Another patchset
is refused (:class:`AlreadyPatched`): revert first. A patched model pickles (``torch.save``,
``copy.deepcopy``) and comes back patched.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import json
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine.errors import AlreadyPatched, NotPatched
from engine.kernels.triton_interpret import is_interpreting
from engine.ops.base import ModuleOp, get_op
from engine.patching.bound_forward import MISSING, Binding, PatchedForward, build_forward, build_impl, rebind_pending
from engine.patching.forwards import ForwardInstall, bottom_slot, install
from engine.planning.fused_head import applied_fused_head, without_fused_head
from engine.planning.planner import Decision, Mode, Plan, plan
from engine.planning.report import Report
from engine.runtime import routing
from engine.runtime.devices import require_present
from engine.runtime.wrappers import unwrap
from engine.schema import Device, Patchset

__all__ = ["STATE_ATTR", "applied_report", "apply", "is_patched", "original_forwards", "revert"]

STATE_ATTR = "_patch_engine_state"


#: One instance forward installed (beneath any library wrapper); undo restores what was there.
_ForwardRecord = ForwardInstall


@dataclass
class _RouterRecord:
    """One use of a function router (counted per model)."""

    namespace: str
    function: str

    def undo(self) -> None:
        routing.release(self.namespace, self.function)


@dataclass
class _HookRecord:
    """One forward pre-hook an op put on a submodule (see ``ModuleOp.pre_hooks``); undo removes exactly it."""

    module: nn.Module
    hook: Callable[..., Any]

    def undo(self) -> None:
        hooks = self.module._forward_pre_hooks
        for key in [k for k, h in hooks.items() if h is self.hook]:
            del hooks[key]

    def redo(self) -> None:
        self.module.register_forward_pre_hook(self.hook)


@dataclass
class _AttributeRecord:
    """An instance attribute apply set (``_can_compile_fullgraph``); undo restores exactly what was there."""

    obj: Any
    name: str
    previous: Any = MISSING

    def undo(self) -> None:
        if self.previous is MISSING:
            self.obj.__dict__.pop(self.name, None)
        else:
            self.obj.__dict__[self.name] = self.previous


def _release_routers(keys: list[tuple[str, str]]) -> None:
    for namespace, function in keys:
        routing.release(namespace, function)


@dataclass
class AppliedState:
    """What :func:`apply` did to a model; stored on the model so that revert, deepcopy and pickle work.

    ``patchset_key`` identifies the patchset's content (not the device or mode), so applying the
    same patchset again is recognized whatever it was planned for.
    """

    patchset_key: str
    report: Report
    records: list[Any] = field(default_factory=list)
    finalizer: weakref.finalize | None = field(default=None, compare=False, repr=False)
    owner_id: int = 0
    owner_ref: weakref.ref | None = field(default=None, compare=False, repr=False)

    def watch(self, owner: nn.Module) -> None:
        """Release this model's function routers if it is garbage-collected without a revert.

        Why: a router left installed for a dead model keeps other models of the family on the
        routed path (an extra call, and a graph break under torch.compile).
        """
        keys = [(r.namespace, r.function) for r in self.records if isinstance(r, _RouterRecord)]
        self.owner_id = id(owner)
        self.owner_ref = weakref.ref(owner)
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
        twin = AppliedState(self.patchset_key, self.report, records)
        owner = memo.get(self.owner_id)  # the copy of the model this state belongs to
        if isinstance(owner, nn.Module):
            twin.watch(owner)
        return twin

    def __reduce__(self) -> tuple[Any, ...]:
        # Data only: the records (modules and what was there before), the report, the owner.
        # The forwards themselves pickle as their bindings (engine.patching.bound_forward.PatchedForward).
        owner = self.owner_ref() if self.owner_ref is not None else None
        return (_restore_state, (self.patchset_key, self.report, self.records, owner))


def _restore_state(patchset_key: str, report: Report, records: list[Any], owner: nn.Module | None) -> AppliedState:
    """Unpickling: take the routers this model uses again, and rebuild its forwards from their bindings."""
    for rec in records:
        if isinstance(rec, _RouterRecord):
            importlib.import_module(rec.namespace)
            routing.acquire(rec.namespace, rec.function)
    state = AppliedState(patchset_key, report, records)
    if owner is not None:
        state.watch(owner)
    for rec in records:  # every submodule is fully loaded by now (they are pickled before this state)
        if isinstance(rec, _ForwardRecord) and "_parameters" in rec.module.__dict__:
            rebind_pending(rec.module)
    return state


def is_patched(model: nn.Module) -> bool:
    return STATE_ATTR in unwrap(model).__dict__


def applied_report(model: nn.Module) -> Report | None:
    state = unwrap(model).__dict__.get(STATE_ATTR)
    return state.report if state else None


def _patchset_key(patchset: Patchset) -> str:
    return json.dumps(patchset.model_dump(mode="json"), sort_keys=True)


def _kernels(decisions: tuple[Decision, ...]) -> list[tuple[Any, ...]]:
    """What a plan installs, module by module, with the settings: equal lists patch the model identically."""
    return [(d.path, d.op, d.action, d.kernel, d.patch) for d in decisions]


def apply(
    model: nn.Module,
    patchset: Patchset | str | dict[str, Any],
    *,
    device: str | Device | torch.device | None = None,
    mode: Mode | None = None,
    fused_cross_entropy: Any = None,
    unverified_release: str | None = None,
    before_install: Callable[[Plan], None] | None = None,
) -> Report:
    """Patch ``model`` in place with ``patchset``; return what was done.

    All checks run first (:func:`engine.plan`, with its ``unverified_release`` policy), then
    ``before_install(plan)`` when the model is about to change (the facade's release gate; it may
    raise), and the device must exist on this machine (:class:`DeviceNotAvailable` otherwise);
    the model changes only if every one passes, and any failure while patching restores it.
    Applying the patchset the model already has is a no-op when it chooses the same kernels, and
    re-patches it when the mode or device needs other ones (after ``model.train()``, kernels with
    a backward) or the fused head is switched (``fused_cross_entropy=True``/``False``/other
    settings; ``None`` keeps the model's); another patchset raises :class:`AlreadyPatched`.
    Verification is not the patcher's job: :func:`engine.apply` (:mod:`engine.api`) runs it.
    ``fused_cross_entropy``: as for :func:`engine.apply` (:mod:`engine.planning.fused_head`).

    A peft ``PeftModel`` is patched as the transformers model inside it (the state lives
    there), so wrapping before or after patching gives the same model.
    """
    model, gate = unwrap(model), before_install or _no_gate
    the_plan = plan(model, patchset, device=device, mode=mode, fused_cross_entropy=fused_cross_entropy,
                    unverified_release=unverified_release)
    if not (the_plan.device is Device.cuda and is_interpreting()):  # interpreted: CUDA kernels on CPU tensors
        require_present(the_plan.device, model)
    key = _patchset_key(without_fused_head(the_plan.patchset))  # the fused head is an option, not the identity
    state: AppliedState | None = model.__dict__.get(STATE_ATTR)
    if state is not None:
        if state.patchset_key != key:
            raise AlreadyPatched(_another_patchset(model, state, the_plan))
        if fused_cross_entropy is None:  # no opinion: keep the fused head the model has (on or off, same settings)
            kept = applied_fused_head(the_plan.patchset, state.report.decisions)
            if kept != the_plan.patchset:
                the_plan = plan(model, kept, device=the_plan.device, mode=the_plan.mode,
                                unverified_release=unverified_release)
        if _kernels(state.report.decisions) == _kernels(the_plan.decisions):
            report = state.report  # the same kernels: nothing to change; the report follows the new plan
            report.device, report.mode, report.decisions = the_plan.device.value, the_plan.mode, the_plan.decisions
        else:
            gate(the_plan)
            report = _repatch(model, state, the_plan)
    else:
        gate(the_plan)
        report = _install(model, the_plan, key)
    return report


def _no_gate(the_plan: Plan) -> None:  # no before_install: nothing to decide between planning and patching
    pass


def _another_patchset(model: nn.Module, state: AppliedState, the_plan: Plan) -> str:
    applied, wanted = state.report.patchset, the_plan.patchset.name
    if applied == wanted:  # same name, other content (an edited copy of the file, say)
        what = (f"another version of {wanted!r} (now from {the_plan.patchset.files[0] if the_plan.patchset.files else 'a dict'}"
                f"; applied from {state.report.files[0] if state.report.files else 'a dict'})")
    else:
        what = f"{wanted!r}"
    return (f"{type(model).__name__} is already patched with {applied!r}, not {what}; revert first "
            "(engine.revert(model)), then apply the other patchset")


def _install(model: nn.Module, the_plan: Plan, key: str) -> Report:
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
    state = AppliedState(key, report, records)
    state.watch(model)
    object.__setattr__(model, STATE_ATTR, state)
    return report


def _repatch(model: nn.Module, old: AppliedState, the_plan: Plan) -> Report:
    """Swap the kernels of a patched model for those of ``the_plan``, all-or-nothing.

    The routers the model uses are held across the swap, so the old forwards (which hold
    their router's context variable) still work if the new ones fail and are put back.
    """
    _prepare(model, the_plan)  # fails before anything changes if a kernel cannot be built
    held = [(r.namespace, r.function) for r in old.records if isinstance(r, _RouterRecord)]
    for namespace, function in held:
        routing.acquire(namespace, function)
    forwards = [r.module for r in old.records if isinstance(r, _ForwardRecord)]
    installed = [(module, module.__dict__.get("forward", MISSING)) for module in forwards]
    try:
        revert(model)
        try:
            return _install(model, the_plan, old.patchset_key)
        except BaseException:
            for namespace, function in held:  # the old state's own uses, released by revert
                routing.acquire(namespace, function)
            for rec in old.records:
                if isinstance(rec, _HookRecord):
                    rec.redo()
            for module, forward in installed:
                if forward is MISSING:
                    module.__dict__.pop("forward", None)
                else:
                    module.__dict__["forward"] = forward
            old.watch(model)
            object.__setattr__(model, STATE_ATTR, old)
            raise
    finally:
        _release_routers(held)


def revert(model: nn.Module) -> bool:
    """Restore every original forward and function of ``model``; ``False`` if it was not patched."""
    state: AppliedState | None = unwrap(model).__dict__.pop(STATE_ATTR, None)
    if state is None:
        return False
    state.unwatch()
    hidden = [rec for rec in reversed(state.records) if rec.undo() is False]
    if hidden:
        names = ", ".join(sorted({type(rec.module).__name__ for rec in hidden}))
        warnings.warn(
            f"revert: {len(hidden)} patched forwards ({names}) are held inside a wrapper added after apply that "
            "the engine cannot see through; they stay patched (they compute the same values). Remove that "
            "wrapper before engine.revert to restore them.",
            RuntimeWarning,
            stacklevel=2,
        )
    return True


@contextlib.contextmanager
def original_forwards(model: nn.Module) -> Iterator[nn.Module]:
    """Inside the block, the patched ``model`` runs its original forwards and functions, on its own parameters.

    Why: comparing a patched model with its original needs the original's numbers, and a
    copy of the model to revert costs the model's memory again. Here every installed forward
    is taken out of its slot (beneath any wrapper, as :func:`revert` does) and put back on
    exit, also on an exception; a function patch is a routing set by its callers' forwards,
    so suspending those forwards suspends it too. The patch state, the routers and the report
    stay as they are. Not thread-safe: other threads see the original forwards meanwhile.

    Raises:
        NotPatched: ``model`` is not patched.
        RuntimeError: a wrapper added after ``apply`` hides an installed forward, so the
            original cannot be run (nothing is changed then).
    """
    model = unwrap(model)
    state: AppliedState | None = model.__dict__.get(STATE_ATTR)
    if state is None:
        raise NotPatched(f"{type(model).__name__} is not patched: it runs its original forwards already")
    forwards = [rec for rec in state.records if isinstance(rec, _ForwardRecord)]
    suspended: list[_ForwardRecord] = []
    try:
        for rec in reversed(forwards):  # last installed first, as revert: a caller's route wraps the op's forward
            if not rec.undo():
                raise RuntimeError(
                    f"{type(rec.module).__name__}: its patched forward is held inside a wrapper added after apply "
                    "that the engine cannot see through, so the original forward cannot be run for comparison; "
                    "remove that wrapper (or verify before adding it)"
                )
            suspended.append(rec)
        yield model
    finally:
        for rec in reversed(suspended):  # first installed first, each beneath every wrapper as at apply
            install(rec.module, bottom_slot(rec.module), rec.installed)


def _prepare(model: nn.Module, the_plan: Plan) -> list[Callable[[list[Any]], None]]:
    """Turn the plan into mutation steps, doing all fallible preparation first."""
    modules = dict(model.named_modules())
    impls: dict[tuple[int, str], Callable[..., Any]] = {}
    steps: list[Callable[[list[Any]], None]] = []

    def impl_for(decision: Decision) -> Callable[..., Any]:
        key = (decision.patch_index, decision.provider.name)  # type: ignore[union-attr]
        if key not in impls:
            impls[key] = build_impl(decision.provider, decision.patch)  # type: ignore[arg-type]
        return impls[key]

    for decision in the_plan.patched:
        op = get_op(decision.op)
        impl = impl_for(decision)
        provider = decision.provider
        assert provider is not None
        if isinstance(op, ModuleOp):
            module = modules[decision.path]
            bottom_slot(module, decision.path)  # ForwardWrapped now, before anything changes
            binding = Binding(decision.path, decision.op, decision.patch, provider.name)
            forward = build_forward(module, binding, impl, provider)
            steps.append(_set_forward_step(module, PatchedForward(forward, module, binding)))
            for sub, hook in op.pre_hooks(module, decision.patch):
                steps.append(_hook_step(module.get_submodule(sub), hook))
        else:
            site = decision.site
            assert site is not None
            steps.append(_router_step(site.namespace, site.function))
            for caller in site.callers:
                bottom_slot(modules[caller], caller)
                steps.append(_route_caller_step(modules[caller], caller, decision, impl, provider))
    if any(d.provider is not None and not d.provider.compile_safe for d in the_plan.patched):
        # Those kernels run between graphs: the instance stops advertising a fullgraph compile (Report says why)
        steps += [_attribute_step(m, "_can_compile_fullgraph", False) for m in modules.values()
                  if getattr(type(m), "_can_compile_fullgraph", False)]
    return steps


def _attribute_step(obj: Any, name: str, value: Any) -> Callable[[list[Any]], None]:
    def step(records: list[Any]) -> None:
        records.append(_AttributeRecord(obj, name, obj.__dict__.get(name, MISSING)))
        obj.__dict__[name] = value

    return step


def _set_forward_step(module: nn.Module, forward: PatchedForward) -> Callable[[list[Any]], None]:
    def step(records: list[Any]) -> None:
        records.append(install(module, bottom_slot(module), forward))

    return step


def _hook_step(module: nn.Module, hook: Callable[..., Any]) -> Callable[[list[Any]], None]:
    def step(records: list[Any]) -> None:
        module.register_forward_pre_hook(hook)
        records.append(_HookRecord(module, hook))

    return step


def _router_step(namespace: str, function: str) -> Callable[[list[Any]], None]:
    def step(records: list[Any]) -> None:
        routing.acquire(namespace, function)
        records.append(_RouterRecord(namespace, function))

    return step


def _route_caller_step(
    module: nn.Module, path: str, decision: Decision, impl: Callable[..., Any], provider: Any
) -> Callable[[list[Any]], None]:
    site = decision.site
    assert site is not None

    def step(records: list[Any]) -> None:
        slot = bottom_slot(module, path)  # beneath any library wrapper
        previous = slot.get()
        binding = Binding(
            path, decision.op, decision.patch, provider.name, route=(site.namespace, site.function), previous=previous
        )
        forward = build_forward(module, binding, impl, provider)  # the router exists: its step ran first
        records.append(install(module, slot, PatchedForward(forward, module, binding)))

    return step
