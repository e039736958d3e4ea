"""The exceptions a user of the engine can catch.

Every error the engine raises on purpose derives from :class:`PatchError`, so one
``except engine.PatchError`` catches them all. Each also derives from the builtin a
PyTorch user would reach for first (``ValueError``, ``LookupError``, ``ImportError``,
``RuntimeError``), so existing ``except`` clauses keep working.
"""

from __future__ import annotations

import os
import re

__all__ = [
    "AlreadyPatched",
    "BackwardUnsupported",
    "DeviceNotAvailable",
    "DTensorUnsupported",
    "DeviceUnsupported",
    "ForwardWrapped",
    "InvalidArgument",
    "KernelNotFound",
    "MissingDependency",
    "ModelTypeMismatch",
    "NotPatched",
    "PatchError",
    "PatchsetError",
    "ReleaseVerificationFailed",
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
    "VersionMismatch",
    "ZeroConfigWarning",
]


class PatchError(Exception):
    """Base class of every error the engine raises on purpose."""


#: The longest run of non-blank characters a message echoes whole (a value, a path, a name), and the
#: longest problem text: a 3 MB ``kernel:`` value or a 5,000-character ``extends:`` name is shown by its ends.
ECHO_LIMIT, PROBLEM_LIMIT = 200, 4000
_LONG_RUN = re.compile(r"\S{%d,}" % (ECHO_LIMIT + 1))


def shortened(text: str) -> str:
    """``text`` with every run of more than :data:`ECHO_LIMIT` non-blank characters cut to its ends and its length."""
    if len(text) <= ECHO_LIMIT:
        return text
    text = _LONG_RUN.sub(lambda m: f"{m.group()[:120]}...[{len(m.group()) - 160:,} more characters]...{m.group()[-40:]}",
                         text)
    if len(text) > PROBLEM_LIMIT:
        text = f"{text[:PROBLEM_LIMIT - 500]}...[{len(text) - PROBLEM_LIMIT + 100:,} more characters]...{text[-400:]}"
    return text


def shown_path(path: object) -> str:
    """A user's path as a message shows it: as written where every character prints, else escaped as ``repr`` does.

    Why: a NUL byte, a newline or a terminal escape in a patchset path was printed raw, so a message could
    hide or forge what follows it; ``'a\\x00b.yaml'`` says exactly what was given. Long paths are cut by
    :func:`shortened` where the message is.
    """
    text = os.fsdecode(path) if isinstance(path, (bytes, os.PathLike)) else str(path)
    return text if text.isprintable() else repr(text)


class _Capped:
    """An error whose message echoes names and lists by their ends (:func:`shortened`), as paths are.

    Why: a 100,000-character target or model type, or a list of 100,000 model types, was repeated whole.
    """

    def __init__(self, *args: object):
        if args and isinstance(args[0], str):
            args = (shortened(args[0]), *args[1:])
        super().__init__(*args)


class PatchsetError(PatchError, ValueError):
    """A patchset file is malformed: YAML syntax, unknown key, wrong value, bad ``extends``.

    Attributes:
        file: the file the problem is in (``None`` for an in-memory patchset).
        line: 1-based line of the offending key or value, when known.
        key: dotted path of the offending key, e.g. ``patches[1].scale``.
        problem: what is wrong, and how to fix it.
    """

    def __init__(self, problem: str, *, file: str | None = None, line: int | None = None, key: str | None = None):
        self.file = file
        self.line = line
        self.key = key
        self.problem = shortened(problem)  # a value is echoed by its ends, never whole (a 3 MB `kernel:`)
        super().__init__(shortened(self.location_prefix()) + self.problem)

    def location_prefix(self) -> str:
        """``file:line: key: `` with whatever parts are known."""
        where = ""
        if self.file is not None:
            where = shown_path(self.file) + (f":{self.line}" if self.line is not None else "") + ": "
        elif self.line is not None:
            where = f"line {self.line}: "
        if self.key:
            where += f"{self.key}: "
        return where


class ModelTypeMismatch(_Capped, PatchError, ValueError):
    """The patchset was written for other ``model_type`` values than the model's."""


class VersionMismatch(PatchError, RuntimeError):
    """The installed library version is outside the range the patchset was written for."""


class TargetNotFound(_Capped, PatchError, LookupError):
    """A declared target (class or function) matched nothing in the model: a silent no-op otherwise."""


class SignatureMismatch(PatchError, TypeError):
    """The target's forward signature is not the one the op requires (e.g. a gated op on a forward without ``gate``)."""


class DeviceUnsupported(PatchError, RuntimeError):
    """The requested kernel cannot run on the device the plan is made for."""


class DeviceNotAvailable(DeviceUnsupported):
    """The device asked for does not exist on this machine, or is not where the model's parameters are.

    A subclass of :class:`DeviceUnsupported`, so ``except DeviceUnsupported`` still catches it;
    the CLI treats it as a usage error (exit 2): the command line asked for the wrong device.
    """


class DTensorUnsupported(DeviceUnsupported):
    """The requested kernel does not take DTensor inputs, and the target's parameters are DTensors (tensor parallel)."""


class ForwardWrapped(PatchError, RuntimeError):
    """A target's forward was replaced by something the engine cannot patch beneath (another library's patch)."""


class BackwardUnsupported(PatchError, RuntimeError):
    """A kernel without a backward was asked to compute gradients (a model patched for inference, now training).

    Raised by the patched forward itself, before the kernel runs, so no wrong gradient is ever produced.
    """


class TrainerConflict(PatchError, ValueError):
    """A trainer does its own thing where a patch would run: TRL computes the head itself, or reads the logits.

    A ``ValueError``, as TRL's own refusals of settings it cannot honour are; the message says
    what the trainer does instead and what to set.
    """


class InvalidArgument(PatchError, ValueError):
    """An argument of an engine function has a value it does not accept (a mode, a device, a model type)."""


class NotPatched(PatchError, ValueError):
    """An operation that needs a patched model (verify without a patchset) was given an unpatched one."""


class MissingDependency(PatchError, ImportError):
    """A kernel needs a Python package that is not installed or does not import."""


class KernelNotFound(PatchError, LookupError):
    """No kernel provider is registered under a name, or none serves an op on a device."""


class AlreadyPatched(PatchError, RuntimeError):
    """The model is already patched by another patchset; revert it first."""


class VerificationFailed(PatchError, AssertionError):
    """A patched module or model does not compute what the original computed.

    Attributes:
        report: the :class:`engine.verification.VerifyReport` with every check (``None`` if not set).
    """

    report = None


class SelfVerificationFailed(VerificationFailed):
    """A patchset not known verified on the installed release (a user's, an edited bundled one) failed its verification there.

    Raised by :func:`engine.apply` before anything changes (``unverified="verify"``, the default),
    with the verifier's finding and the ``file:line`` of each patch whose declaration does not fit.

    Attributes:
        finding: the verifier's failure message (modules, declarations, errors), also in the text.
        verdict: the :class:`engine.releases.ReleaseVerdict` (cached on disk, with its path).
    """

    finding = ""
    verdict = None


class ReleaseVerificationFailed(VersionMismatch, SelfVerificationFailed):
    """The installed transformers is outside a patchset's verified range, and verifying it there failed.

    Raised by :func:`engine.apply` before anything changes (``unverified="verify"``, the
    default): a :class:`VersionMismatch` (the release is the cause) and a :class:`VerificationFailed`
    (the verifier found it), so either ``except`` catches it.

    Attributes:
        finding: the verifier's failure message (modules, declarations, errors), also in the text.
        verdict: the :class:`engine.releases.ReleaseVerdict` (cached on disk, with its path).
    """


class VerificationNotRun(PatchError, RuntimeError):
    """The verification a patchset needed before patching could not run (an exception, or no check): no verdict.

    Nothing was patched and nothing was cached: it is neither a pass nor a failure. ``cause`` says
    why; the message says how to proceed.
    """

    cause = ""


class UnverifiedContent(PatchError, RuntimeError):
    """``unverified="refuse"``: a patchset not known verified on the installed release was refused unverified."""


class UnverifiedContentWarning(UserWarning):
    """A patchset not known verified on the installed release was verified there first, or trusted unverified.

    Filter it (and :class:`UnverifiedReleaseWarning`, its kind for a release outside the range) with
    ``warnings.filterwarnings("ignore", category=engine.UnverifiedContentWarning)``.
    """


class UnverifiedReleaseWarning(UnverifiedContentWarning):
    """A patchset was applied on a transformers release outside its verified range: self-verified there, or trusted.

    Says the release, the verdict and where it is cached; filter it with
    ``warnings.filterwarnings("ignore", category=engine.UnverifiedReleaseWarning)``.
    """


class VerdictCacheWarning(UserWarning):
    """The self-verification cache could not be read or written; the engine verified again instead."""


class ZeroConfigWarning(UserWarning):
    """``engine.apply(model)`` with no patchset patched nothing, or left measured declarations unpatched.

    The report's ``zero_config`` says what was measured and why each is not patched; pass
    ``strict=True`` to make it an error instead.
    """
