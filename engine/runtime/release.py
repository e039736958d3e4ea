"""Is a patchset for the installed transformers? Asked first, before anything is built or loaded.

Why a check of its own, run at every entry point (``engine.plan`` and so ``apply``, the tiny
model of ``patch-engine plan|verify``, ``coverage``, the scaffold, a checkpoint's verification
and benchmark): a bundled patchset verified on newer releases only used to reach the user as
whatever broke first under an older one. ``deepseek_v32`` under transformers 5.6 said "unknown
model type ... did you mean 'deepseek_v3'", ``paligemma`` failed inside transformers while its
tiny model was built. The true answer is the version: the range the patchset is verified on
(``requires``, checked by the compatibility matrix) and the installed release, as
:class:`VersionMismatch`.

Two questions, in this order: does ``requires.transformers`` hold the installed release, and
does the release define the patchset's model type at all. Outside the range, the
``unverified`` policy (:mod:`engine.foundation.release_policy`) decides: ``refuse``
raises here (:func:`engine.foundation.versions.check_requires`); ``verify`` and ``trust`` return an
:class:`OutsideRange` that the plan carries, and :func:`engine.apply` verifies the patchset on the
installed release before patching (:mod:`engine.releases`) or warns. A model type the release
lacks is refused whatever the policy (there is nothing to verify on); that second question is
asked of bundled patchsets (a user's file naming an unknown type is more likely a typo: its
caller says so, with suggestions) and, for a model type alone (the scaffold), of the bundled
patchset that covers it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.errors import VersionMismatch
from engine.foundation.release_policy import OutsideRange, resolve_policy
from engine.foundation.versions import check_requires, in_range, installed_version

__all__ = ["bundled_covering", "check_release", "is_bundled", "known_model_type", "verify_command"]


def known_model_type(model_type: str) -> bool:
    """Whether the installed transformers (or a package that registered it, e.g. fla) defines ``model_type``."""
    from transformers import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


def is_bundled(patchset: Any) -> bool:
    """Whether ``patchset`` was loaded from the bundled folder (one of ours, with a matrix-checked range)."""
    from engine.loader.names import bundled_dir

    files = list(getattr(patchset, "files", None) or [])
    return bool(files) and Path(files[0]).resolve().parent == bundled_dir().resolve()


def verify_command(patchset: Any) -> str | None:
    """What to pass to ``patch-engine verify`` for ``patchset``, so a suggested command works as printed.

    A bundled patchset: its name. A user's file: its absolute path, quoted for a shell (its bare
    name resolves to the bundled folder first, then to the working folder: from anywhere else it
    fails). ``None`` for a patchset built in memory (a dict): it has nothing to name.
    """
    import shlex

    files = list(getattr(patchset, "files", None) or [])
    if not files:
        return None
    if is_bundled(patchset):
        return str(patchset.name)
    return shlex.quote(str(Path(files[0]).resolve()))


def _absent(name: str, model_type: str, spec: str | None) -> VersionMismatch:
    verified = f"transformers{spec}" if spec else "newer transformers releases"
    return VersionMismatch(
        f"patchset {name!r} is for model type {model_type!r}, which transformers {installed_version() or 'none'} "
        f"does not define; the patchset is verified on {verified} (docs/compatibility.md). Nothing was built "
        "or patched. Install a transformers in that range."
    )


def check_release(patchset: Any, model_type: str | None = None, *, policy: str | None = None) -> OutsideRange | None:
    """Is ``patchset`` for this transformers? Asked before anything is built: see the module docstring.

    ``model_type`` is the type about to be built (a tiny model's); by default any of the
    patchset's ``model_types`` will do. ``policy`` is the ``unverified_release`` setting
    (:func:`engine.foundation.release_policy.resolve_policy`: default from the environment, else
    ``verify``).

    Returns:
        ``None`` when ``requires`` holds the installed release; an :class:`OutsideRange` when it
        does not and the policy lets the release through (``verify``: the caller verifies it on
        this release before patching, :mod:`engine.releases`; ``trust``: it warns).

    Raises:
        VersionMismatch: ``requires`` leaves out the installed release and the policy is
            ``refuse``; or a bundled patchset's model type is not defined by the installed release
            (whatever the policy: there is nothing to verify it on).
        InvalidArgument: ``policy`` (or the environment variable) is not a policy.
    """
    resolved = resolve_policy(policy)
    spec = patchset.requires.transformers if patchset.requires is not None else None
    if resolved == "refuse":
        command = verify_command(patchset)
        check_requires(patchset.name, spec, verify_hint=f"patch-engine verify {command}" if command else
                       "engine.verify(model, patchset) on a model of its type, which patches, verifies and reverts it")
    # a type the patchset does not declare is the caller's to refuse (a typo gets suggestions there)
    types = [model_type] if model_type in patchset.model_types else list(patchset.model_types)
    if types and is_bundled(patchset) and not any(known_model_type(t) for t in types):
        raise _absent(patchset.name, types[0], spec)
    installed = installed_version()
    if not in_range(spec, installed):
        return OutsideRange(patchset.name, str(spec), installed or "none", resolved)
    return None


def bundled_covering(model_type: str) -> VersionMismatch | None:
    """The refusal for a model type this transformers lacks but a bundled patchset covers, else ``None``.

    Only asked on the error path (it reads every bundled patchset): ``scaffold deepseek_v32``
    under a release without it should name the release, not suggest ``deepseek_v3``.
    """
    from engine.loader import bundled_names, load_patchset

    for name in bundled_names():
        try:
            patchset = load_patchset(name)
        except Exception:  # noqa: BLE001, S112  (a broken bundled file is the loader tests' business, not this message's)
            continue
        if model_type in patchset.model_types:
            return _absent(name, model_type, patchset.requires.transformers if patchset.requires else None)
    return None
