"""The forwards the engine installs on module instances: callable fast, picklable as data.

Why not ``MethodType(closure, module)``: a closure (and the lambdas a provider may build)
cannot be pickled, so ``torch.save(model)`` and ``pickle.dumps(model)`` of a patched model
failed. A :class:`PatchedForward` is a ``functools.partial(fn, module)`` (called in C, as
cheap as a bound method plus ~50 ns) that also carries a :class:`Binding`: which op, patch
settings and kernel provider made it. Pickling stores the binding, never the function; on
unpickling the forward is rebuilt from the registry (eagerly by the model's patch state once
every module is loaded, or lazily at its first call), so the loaded model comes back patched
and computes what the saved one did.

A kernel without a backward gets a guard in front of it: a forward that would need
gradients through it raises :class:`BackwardUnsupported` instead of returning numbers whose
gradients are wrong (a model patched for inference, then switched to training).
"""

from __future__ import annotations

import copy
import functools
import importlib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.errors import BackwardUnsupported, MissingDependency
from engine.kernels import registry
from engine.kernels.registry import KernelProvider
from engine.ops.base import ModuleOp, get_op
from engine.runtime import routing

__all__ = ["MISSING", "Binding", "PatchedForward", "build_forward", "build_impl", "rebind_pending", "unbound_forward"]


class _Missing:
    """Marks 'the instance had no forward attribute'; one object, also across deepcopy and pickle."""

    def __deepcopy__(self, memo: dict[int, Any]) -> _Missing:
        return self

    def __reduce__(self) -> str:
        return "MISSING"  # pickled by reference to the module-level singleton

    def __repr__(self) -> str:
        return "<no instance forward>"


MISSING = _Missing()


@dataclass(frozen=True)
class Binding:
    """What an installed forward is made of, as data: enough to rebuild it in another process.

    Attributes:
        path: the module's path in the model (for messages).
        op: the op name; ``patch`` its settings; ``provider`` the kernel provider's name.
        route: ``(namespace, function)`` when the forward routes a module-level function
            (the module is a caller of a function patch), else ``None``.
        previous: for a route, the forward it wraps (``MISSING``: the class's).
    """

    path: str
    op: str
    patch: Any
    provider: str
    route: tuple[str, str] | None = None
    previous: Any = MISSING


class PatchedForward(functools.partial):
    """``fn(module, *args, **kwargs)`` with the :class:`Binding` it was built from; pickles as the binding."""

    __slots__ = ("binding",)
    binding: Binding

    def __new__(cls, fn: Callable[..., Any], module: nn.Module, binding: Binding) -> PatchedForward:
        self = super().__new__(cls, fn, module)
        self.binding = binding
        return self

    @property
    def __self__(self) -> nn.Module:  # read like a bound method: the module it is bound to
        return self.args[0]

    @property
    def __func__(self) -> Callable[..., Any]:
        return self.func

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore_forward, (self.args[0], self.binding))

    def __deepcopy__(self, memo: dict[int, Any]) -> PatchedForward:
        # The function reads everything module-specific from its `self` argument: share it.
        return PatchedForward(self.func, copy.deepcopy(self.args[0], memo), self.binding)

    def __repr__(self) -> str:
        b = self.binding
        return f"<patched forward of {type(self.args[0]).__name__} ({b.op} via {b.provider})>"


def build_impl(provider: KernelProvider, patch: Any) -> Callable[..., Any]:
    """The provider's kernel for ``patch``; one that dynamo cannot trace runs as a graph break."""
    impl = provider.build(patch)
    if not provider.compile_safe:
        # torch.compile of the model must not fail on a kernel dynamo cannot trace:
        # the kernel runs eagerly, as a graph break (listed in Report.compile_disabled).
        impl = torch.compiler.disable(impl, recursive=True)
    return impl


def build_forward(
    module: nn.Module, binding: Binding, impl: Callable[..., Any], provider: KernelProvider
) -> Callable[..., Any]:
    """The plain function ``forward(self, ...)`` for ``module`` (to wrap in a :class:`PatchedForward`)."""
    if binding.route is None:
        op = get_op(binding.op)
        assert isinstance(op, ModuleOp), f"{binding.op} binds module forwards"
        fn = op.bind(module, binding.patch, impl)
    else:
        fn = _routed_forward(module, binding.route, impl, binding.previous)
        if not provider.compile_safe:
            # The kernel breaks dynamo's graph, and a graph break inside the routed forward makes
            # dynamo run that forward eagerly while it compiles the callee, where the eager route
            # (the context variable) cannot be read: the callee would reach the original function.
            # So the whole caller runs eagerly, on the eager route (listed in Report.compile_disabled).
            fn = torch.compiler.disable(fn, recursive=True)
    if not provider.has_backward:
        fn = _no_backward_guard(fn, binding, type(module).__name__)
    return fn


def _routed_forward(
    module: nn.Module, route: tuple[str, str], impl: Callable[..., Any], previous: Any
) -> Callable[..., Any]:
    """A caller's forward that routes the function to ``impl`` for the duration of the call."""
    router = routing.router_for(*route)
    if router is None:
        raise RuntimeError(f"no router for {route[0]}.{route[1]}; the patch state acquires it before binding")
    inner = unbound_forward(module, previous)
    active, traced = router.active, router.traced

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # dynamo traces a list, not a ContextVar (engine/runtime/routing.py)
            traced.append(impl)
            try:
                return inner(self, *args, **kwargs)
            finally:
                traced.pop()
        token = active.set(impl)
        try:
            return inner(self, *args, **kwargs)
        finally:
            active.reset(token)

    return forward


def unbound_forward(module: nn.Module, previous: Any) -> Callable[..., Any]:
    """The forward to call as ``f(self, ...)``, without holding a bound method (deepcopy-safe)."""
    if previous is MISSING:
        return type(module).forward
    if getattr(previous, "__self__", None) is module and hasattr(previous, "__func__"):
        return previous.__func__  # a bound method, or a PatchedForward of this module
    return lambda self, *args, **kwargs: previous(*args, **kwargs)


def _needs_grad(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    if any(isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values())):
        return True
    return any(p.requires_grad for p in module.parameters())


def _no_backward_guard(fn: Callable[..., Any], binding: Binding, cls: str) -> Callable[..., Any]:
    message = (
        f"{binding.path} ({cls}) runs kernel {binding.provider!r} for {binding.op}, which has no backward "
        "(the patchset was applied for inference), and this forward needs gradients: they would be wrong. "
        "Apply the patchset again now that the model trains (engine.apply(model, patchset) after "
        "model.train() re-plans with kernels that have a backward), run under torch.no_grad(), "
        "or engine.revert(model)."
    )

    @functools.wraps(fn)
    def guarded(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and _needs_grad(self, args, kwargs):
            raise BackwardUnsupported(message)
        return fn(self, *args, **kwargs)

    return guarded


# ---- unpickling ---------------------------------------------------------------------------

_REBUILT: dict[tuple[str, str, str], Callable[..., Any]] = {}  # one kernel per (provider, op, settings)


def _provider_here(binding: Binding) -> KernelProvider:
    """The binding's provider, or the torch reference when it cannot run in this process."""
    from engine.runtime.devices import current_device

    provider = registry.get(binding.provider, binding.op)
    try:
        provider.check_dependencies()
        if current_device() not in provider.devices:
            raise MissingDependency(f"it runs on {provider.device_list()}, this machine on {current_device().value}")
    except MissingDependency as exc:
        warnings.warn(
            f"patch-engine: {binding.path} was saved patched with kernel {binding.provider!r}, which cannot run "
            f"here ({exc}); it runs the torch reference of {binding.op} instead (the same numbers)",
            stacklevel=3,
        )
        provider = registry.get("torch", binding.op)
    return provider


def _rebuild(module: nn.Module, binding: Binding) -> Callable[..., Any]:
    provider = _provider_here(binding)
    key = (provider.name, binding.op, binding.patch.model_dump_json())
    impl = _REBUILT.get(key)
    if impl is None:
        impl = _REBUILT[key] = build_impl(provider, binding.patch)
    if binding.route is not None:
        importlib.import_module(binding.route[0])
    return build_forward(module, binding, impl, provider)


class _Pending:
    """Stands in for an unpickled forward until the model's state (or its first call) rebuilds it."""

    def __init__(self, binding: Binding):
        self.binding = binding
        self.fn: Callable[..., Any] | None = None

    def build(self, module: nn.Module) -> Callable[..., Any]:
        if self.fn is None:
            self.fn = _rebuild(module, self.binding)
        return self.fn

    def __call__(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        fn = self.build(module)
        rebind_pending(module)
        return fn(module, *args, **kwargs)


def _restore_forward(module: nn.Module, binding: Binding) -> PatchedForward:
    # `module` may still be empty here (pickle restores its state after this), so nothing is built yet.
    return PatchedForward(_Pending(binding), module, binding)


def rebind_pending(module: nn.Module) -> None:
    """Replace an unpickled module's pending forward by the rebuilt one (no-op otherwise)."""
    current = module.__dict__.get("forward")
    if isinstance(current, PatchedForward) and isinstance(current.func, _Pending):
        module.__dict__["forward"] = PatchedForward(current.func.build(module), module, current.binding)
