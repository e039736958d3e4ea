"""Library versions: is the installed transformers in a patchset's ``requires``, and in a patch's ``when``?

Why a module of its own: two declarations read the installed version. ``requires`` says which
transformers releases a whole patchset was verified on (``docs/compatibility.md`` is the
matrix that checks it); outside them the policy of :mod:`engine.foundation.release_policy`
decides (verify on the installed release, refuse with :func:`check_requires`, or trust).
``when`` on one patch says which releases have the modeling code that patch is written for (an
experts class that appeared in 5.10, a rope function renamed in 5.8); :func:`patch_is_active`
leaves the other patches out. See docs/versions.md.

Torch-free: the version is read from ``transformers.__version__`` when transformers is
already imported, else from its installed metadata, so validating a patchset imports nothing heavy.
"""

from __future__ import annotations

import sys
from importlib import metadata

from engine.errors import VersionMismatch
from engine.foundation.release_policy import ENV_VAR as RELEASE_ENV_VAR

__all__ = ["check_requires", "in_range", "installed_version", "patch_is_active", "when_text"]


def installed_version(library: str = "transformers") -> str | None:
    """The installed version of ``library`` (``None`` when it is not installed)."""
    module = sys.modules.get(library)
    version = getattr(module, "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return metadata.version(library)
    except metadata.PackageNotFoundError:
        return None


def in_range(spec: str | None, version: str | None) -> bool:
    """Whether ``version`` is in the PEP 440 range ``spec`` (no range: every version; pre-releases count)."""
    if spec is None:
        return True
    if version is None:
        return False
    from packaging.specifiers import SpecifierSet

    return version in SpecifierSet(spec, prereleases=True)


def when_text(when: object) -> str:
    """``transformers<5.10`` for a ``when`` (``""`` for none), as plans and messages show it."""
    spec = getattr(when, "transformers", None)
    return f"transformers{spec}" if spec else ""


def patch_is_active(patch: object, version: str | None = None) -> bool:
    """Whether ``patch`` is for the installed transformers (or ``version``): no ``when``, or in it."""
    when = getattr(patch, "when", None)
    spec = getattr(when, "transformers", None)
    return in_range(spec, version if version is not None else installed_version())


def check_requires(name: str, spec: str | None, version: str | None = None, *, verify_hint: str | None = None) -> None:
    """Refuse a patchset whose ``requires.transformers`` range leaves out the installed version.

    ``verify_hint`` is how to verify this patchset, as it works when printed (a user's file:
    ``patch-engine verify /abs/path.yaml``; a dict: a Python call); default:
    ``patch-engine verify NAME`` (a bundled one).

    Raises:
        VersionMismatch: naming the range it was verified on, the installed version, and the fixes.
    """
    installed = version if version is not None else installed_version()
    if in_range(spec, installed):
        return
    raise VersionMismatch(
        f"patchset {name!r} requires transformers{spec}; installed is {installed or 'none'}. {spec} are the "
        "versions it is verified on (docs/compatibility.md); nothing was patched (unverified='refuse'). "
        "Let the engine verify it on this release first (unverified='verify', the default; "
        f"--unverified verify; ${RELEASE_ENV_VAR}=verify), install a transformers in that range, or verify the "
        f"patchset ({verify_hint or f'patch-engine verify {name}'}) and widen `requires`, with `when` ranges on the patches "
        "whose target changed (docs/versions.md)."
    )
