"""patch-engine: declarative patchsets that swap transformers module forwards for fused kernels.

Example:
    >>> import engine
    >>> report = engine.apply(model, "qwen3")          # doctest: +SKIP
    >>> print(report)                                  # doctest: +SKIP
    >>> engine.revert(model)                           # doctest: +SKIP

``import engine`` imports neither torch nor transformers: the names below are loaded on
first use (PEP 562), so ``engine.load_patchset`` and ``patch-engine validate`` stay fast
enough for a pre-commit hook. The error types are plain and always loaded.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from engine.errors import (
    AlreadyPatched,
    BackwardUnsupported,
    DeviceNotAvailable,
    DeviceUnsupported,
    DTensorUnsupported,
    ForwardWrapped,
    InvalidArgument,
    KernelNotFound,
    MissingDependency,
    ModelTypeMismatch,
    NotPatched,
    PatchError,
    PatchsetError,
    ReleaseVerificationFailed,
    SelfVerificationFailed,
    SignatureMismatch,
    TargetNotFound,
    TrainerConflict,
    UnverifiedContent,
    UnverifiedContentWarning,
    UnverifiedReleaseWarning,
    VerdictCacheWarning,
    VerificationFailed,
    VerificationNotRun,
    VersionMismatch,
    ZeroConfigWarning,
)
from engine.foundation.moved import MOVED as _MOVED
from engine.foundation.moved import install as _install_moved_paths
from engine.foundation.moved import message as _moved_message

_install_moved_paths()  # each module path from before the layer packages imports as the module it moved to

if TYPE_CHECKING:
    from engine.api import apply, is_patched, plan, revert, verify
    from engine.auditing import AuditReport, audit
    from engine.loader import load_patchset
    from engine.planning.planner import Plan
    from engine.planning.report import Report
    from engine.runtime.hub_functions import torch_path
    from engine.scaffolding import scaffold
    from engine.schema import Patchset
    from engine.verification import VerifyReport

__version__ = "0.1.0"

#: Public name -> the module that defines it, imported on first access.
_LAZY: dict[str, str] = {
    "apply": "engine.api",
    "is_patched": "engine.api",
    "plan": "engine.api",
    "revert": "engine.api",
    "verify": "engine.api",
    "load_patchset": "engine.loader",
    "Patchset": "engine.schema",
    "Plan": "engine.planning.planner",
    "Report": "engine.planning.report",
    "VerifyReport": "engine.verification",
    "torch_path": "engine.runtime.hub_functions",
    "scaffold": "engine.scaffolding",
    "audit": "engine.auditing",
    "AuditReport": "engine.auditing",
}

__all__ = [
    "AlreadyPatched",
    "AuditReport",
    "BackwardUnsupported",
    "DTensorUnsupported",
    "DeviceNotAvailable",
    "DeviceUnsupported",
    "ForwardWrapped",
    "InvalidArgument",
    "KernelNotFound",
    "MissingDependency",
    "ModelTypeMismatch",
    "NotPatched",
    "PatchError",
    "Patchset",
    "PatchsetError",
    "Plan",
    "ReleaseVerificationFailed",
    "Report",
    "SelfVerificationFailed",
    "SignatureMismatch",
    "TargetNotFound",
    "TrainerConflict",
    "UnverifiedContent",
    "UnverifiedContentWarning",
    "UnverifiedReleaseWarning",
    "VerdictCacheWarning",
    "VerificationFailed",
    "VerificationNotRun",
    "VerifyReport",
    "VersionMismatch",
    "ZeroConfigWarning",
    "apply",
    "audit",
    "is_patched",
    "load_patchset",
    "plan",
    "revert",
    "scaffold",
    "torch_path",
    "verify",
]


def __getattr__(name: str) -> Any:
    """Load a public name (or a submodule, e.g. ``engine.patching.patcher``) on first access."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if f"{__name__}.{name}" in _MOVED:  # an old path as an attribute: warn where the user wrote it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            module = importlib.import_module(f"{__name__}.{name}")
        warnings.warn(_moved_message(f"{__name__}.{name}"), DeprecationWarning, stacklevel=2)
        return module
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
