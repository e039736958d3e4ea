"""patch-engine: declarative patchsets that swap transformers module forwards for fused kernels.

Example:
    >>> import engine
    >>> report = engine.apply(model, "qwen3")          # doctest: +SKIP
    >>> print(report)                                  # doctest: +SKIP
    >>> engine.revert(model)                           # doctest: +SKIP
"""

from engine.errors import (
    AlreadyPatched,
    DeviceUnsupported,
    KernelNotFound,
    MissingDependency,
    ModelTypeMismatch,
    PatchError,
    PatchsetError,
    SignatureMismatch,
    TargetNotFound,
    VerificationFailed,
    VersionMismatch,
)
from engine.hub_functions import torch_path
from engine.loader import load_patchset
from engine.patcher import apply, is_patched, revert
from engine.planner import Plan, plan
from engine.report import Report
from engine.schema import Patchset
from engine.verify import VerifyReport, verify

__version__ = "0.1.0"

__all__ = [
    "AlreadyPatched",
    "DeviceUnsupported",
    "KernelNotFound",
    "MissingDependency",
    "ModelTypeMismatch",
    "PatchError",
    "Patchset",
    "PatchsetError",
    "Plan",
    "Report",
    "SignatureMismatch",
    "TargetNotFound",
    "VerificationFailed",
    "VerifyReport",
    "VersionMismatch",
    "apply",
    "is_patched",
    "load_patchset",
    "plan",
    "revert",
    "torch_path",
    "verify",
]
