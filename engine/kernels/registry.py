"""The kernel registry: which provider implements which op on which devices.

A provider is registered once per (name, op); a duplicate registration is a bug and is
refused. ``auto`` walks :data:`AUTO_ORDER` for the device, a data table, and takes the
first provider that implements the op, supports the mode, and whose dependencies import.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidArgument, KernelNotFound, MissingDependency
from engine.schema import Device
from engine.schema import kernel_names as _names

__all__ = [
    "ALL_DEVICES",
    "AUTO_ORDER",
    "Dependency",
    "KernelProvider",
    "get",
    "kernel_names",
    "providers_for",
    "register",
    "unregister",
    "all_providers",
]

ALL_DEVICES: frozenset[Device] = frozenset(Device)

#: The order in which ``kernel: auto`` tries providers, per device. Names with no provider
#: for an op are passed over; ``torch`` (the reference) ends every list.
AUTO_ORDER: dict[Device, tuple[str, ...]] = {
    Device.cuda: ("liger", "fla", "grouped_mm", "torch"),
    Device.npu: ("npu", "liger", "fla", "torch"),
    Device.cpu: ("compiled", "grouped_mm", "torch"),
    Device.xpu: ("torch",),
    Device.mps: ("torch",),
}


@dataclass(frozen=True)
class Dependency:
    """A Python package a provider imports, and the extra of ours that installs it."""

    module: str  # import name, e.g. "liger_kernel"
    package: str  # distribution name, e.g. "liger-kernel"
    extra: str  # our extra, e.g. "cuda"
    #: What else the package needs when it is installed but does not import (e.g. CANN for torch_npu).
    broken_hint: str = ""

    def check(self) -> None:
        """Import the module; raise :class:`MissingDependency` that says how to fix it."""
        hint = f'pip install "patch-engine[{self.extra}]"'
        if importlib.util.find_spec(self.module) is None:
            raise MissingDependency(f"{self.package} is not installed (import {self.module!r} failed); {hint}")
        try:
            importlib.import_module(self.module)
        except Exception as exc:  # installed but broken, e.g. torch_npu without CANN
            hint = f" {self.broken_hint}" if self.broken_hint else ""
            raise MissingDependency(
                f"{self.package} is installed but `import {self.module}` failed: {type(exc).__name__}: {exc}.{hint}"
            ) from exc


@dataclass(frozen=True)
class KernelProvider:
    """One implementation of one op.

    Attributes:
        name: the name patchsets use (``torch``, ``compiled``, ``liger``, ``npu``, ``fla``).
        op: the op it implements.
        devices: the device types it runs on.
        build: ``build(patch) -> impl``: imports lazily and returns the op's kernel function,
            specialized to the patch's settings. Its signature is the op's kernel signature.
        requires: Python packages it imports.
        has_backward: whether autograd works through it (training needs it).
        compile_safe: whether ``torch.compile`` can trace it without an error.
        supports: ``supports(patch) -> None`` if the provider reproduces the patch's declared
            numerics, else the reason it does not (``kernel: auto`` then passes it over).
        dtensor: whether it takes ``DTensor`` inputs (tensor-parallel parameters). Vendor
            kernels are raw pointers into local memory and do not (Liger's failed on DTensor
            under TP); ``auto`` passes such a provider over for a target with DTensor
            parameters, and naming it explicitly is a plan-time error.
        rule_note: ``rule_note() -> str``: where the provider computes the op itself and where it
            hands a call to the op's reference at run time (a measured rule, e.g. ``compiled``'s
            rows per dtype), appended to the plan's reason so that the plan says what will run.
    """

    name: str
    op: str
    devices: frozenset[Device]
    build: Callable[[Any], Callable[..., Any]]
    requires: tuple[Dependency, ...] = ()
    has_backward: bool = True
    compile_safe: bool = True
    description: str = ""
    supports: Callable[[Any], str | None] | None = None
    dtensor: bool = False
    rule_note: Callable[[], str] | None = None

    def __reduce__(self) -> tuple[Any, ...]:
        # Providers are registry singletons whose `build` may be a lambda: pickle the name.
        return (get, (self.name, self.op))

    def check_dependencies(self) -> None:
        for dep in self.requires:
            dep.check()

    def device_list(self) -> str:
        return " or ".join(sorted(d.value for d in self.devices))


_PROVIDERS: dict[tuple[str, str], KernelProvider] = {}


def register(provider: KernelProvider) -> KernelProvider:
    """Add a provider; registering the same (name, op) twice is refused."""
    key = (provider.name, provider.op)
    if key in _PROVIDERS:
        raise InvalidArgument(
            f"kernel {provider.name!r} for op {provider.op!r} is already registered; "
            "pick another name, or unregister(name, op) the existing one first"
        )
    _PROVIDERS[key] = provider
    _names.add(provider.name)
    return provider


def unregister(name: str, op: str) -> KernelProvider:
    """Remove a provider (plugins and tests that register their own); KernelNotFound if absent."""
    try:
        provider = _PROVIDERS.pop((name, op))
    except KeyError:
        raise KernelNotFound(f"no kernel {name!r} for op {op!r} is registered") from None
    if not any(n == name for n, _ in _PROVIDERS):
        _names.discard(name)
    return provider


def all_providers() -> list[KernelProvider]:
    """Every registered provider, bundled ones included."""
    _ensure_loaded()
    return list(_PROVIDERS.values())


def _ensure_loaded() -> None:
    import engine.kernels  # noqa: F401  (registers the bundled providers)


def get(name: str, op: str) -> KernelProvider:
    """The provider ``name`` for ``op``; :class:`KernelNotFound` lists what exists."""
    _ensure_loaded()
    try:
        return _PROVIDERS[(name, op)]
    except KeyError:
        offered = sorted(n for (n, o) in _PROVIDERS if o == op)
        raise KernelNotFound(
            f"no kernel {name!r} for op {op!r}; kernels for {op}: {', '.join(offered) or 'none'}"
        ) from None


def providers_for(op: str) -> list[KernelProvider]:
    _ensure_loaded()
    return [p for (n, o), p in _PROVIDERS.items() if o == op]


def kernel_names() -> set[str]:
    """Every registered provider name (for schema validation)."""
    _ensure_loaded()
    return {name for name, _ in _PROVIDERS}
