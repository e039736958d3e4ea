"""What unverified content gets: ``verify`` (first, the default), ``refuse``, ``trust``. One setting, read the same everywhere.

What is *unverified*: anything not known verified on the installed transformers release. Known
verified are the bundled patchsets' contents on the releases the compatibility matrix verified
them on (:mod:`engine.releases.manifest`) and a content with a passing verdict of its own in the
user's cache (an earlier self-verification). Everything else is unverified: a user's file or
dict, inside its ``requires`` range or not, an edited bundled file, a bundled file on a release
CI did not run. Why not trust a range: the range a user types decides nothing (a copy of
``qwen3.yaml`` with one flipped ``scale`` kept inside its range patched silently, the bug this
project was founded on), and a release past the range is merely unverified, not wrong (87 of the
89 bundled patchsets verified on 5.25.0 as they were). So:

* ``verify`` (the default): the engine verifies the content on the installed release first, on a
  tiny model of the user's model type, with the plan's device, dtype, mode and kernels, and caches
  the verdict (:mod:`engine.releases`); a failure refuses with the finding;
* ``refuse``: what is not known verified is refused: a release outside ``requires`` at plan time
  (:class:`VersionMismatch`, as before 5.25), other unverified content when ``apply`` would patch;
* ``trust``: applied without verification, with a warning.

The setting is ``unverified=`` of ``engine.apply`` / ``plan`` / ``verify``, the CLI's
``--unverified``, and, where none of those says, ``$PATCH_ENGINE_UNVERIFIED``. Its first name,
from when only a release outside the range was verified, keeps working everywhere:
``unverified_release=``, ``--unverified-release``, ``$PATCH_ENGINE_UNVERIFIED_RELEASE`` and every
integration's ``unverified_release`` config key. Torch-free.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from engine.errors import InvalidArgument

__all__ = ["ENV_VAR", "ENV_VARS", "OLD_ENV_VAR", "POLICIES", "OutsideRange", "Policy", "either", "resolve_policy"]

Policy = Literal["verify", "refuse", "trust"]
POLICIES: tuple[Policy, ...] = ("verify", "refuse", "trust")
ENV_VAR = "PATCH_ENGINE_UNVERIFIED"
#: The setting's first name (``unverified_release``), still read where the new one is unset.
OLD_ENV_VAR = "PATCH_ENGINE_UNVERIFIED_RELEASE"
ENV_VARS = (ENV_VAR, OLD_ENV_VAR)
_MEANING = ("verify (default: verify it on the installed release first, verdict cached), refuse (refuse what is not "
            "known verified), trust (apply without verifying, with a warning)")


def either(unverified: str | None, unverified_release: str | None, *, where: str = "") -> str | None:
    """The one value of the setting given by its name or its old name (``None``: neither); both, differing: an error."""
    if unverified is not None and unverified_release is not None and \
            str(unverified).strip().lower() != str(unverified_release).strip().lower():
        raise InvalidArgument(f"{where}unverified={unverified!r} and unverified_release={unverified_release!r} "
                              "disagree; they are one setting (unverified_release is its old name): give one")
    return unverified if unverified is not None else unverified_release


def resolve_policy(value: str | None = None, *, setting: str = "unverified") -> Policy:
    """The policy: ``value`` if given, else ``$PATCH_ENGINE_UNVERIFIED``, else ``$PATCH_ENGINE_UNVERIFIED_RELEASE``, else ``"verify"``.

    ``setting`` names where ``value`` came from (a keyword, a CLI flag, a config key), so that a
    bad value is reported where the user wrote it.

    Raises:
        InvalidArgument: the value (or the environment variable) is not one of :data:`POLICIES`.
    """
    if value is None or value == "":
        for name in ENV_VARS:
            env = os.environ.get(name, "").strip()
            if env:
                value, setting = env, f"${name}"
                break
        else:
            return "verify"
    text = str(value).strip().lower()
    if text in POLICIES:
        return text  # type: ignore[return-value]
    raise InvalidArgument(f"{setting}={str(value)[:80]!r} is not a policy for content not known verified on the "
                          f"installed transformers (a user's patchset, an edited bundled one, a release outside its "
                          f"verified range); use one of: {_MEANING}")


@dataclass(frozen=True)
class OutsideRange:
    """The installed transformers is outside the range a patchset was verified on, and the policy lets it through."""

    patchset: str
    spec: str  # the patchset's requires.transformers, e.g. ">=5.0,<5.26"
    installed: str
    policy: Policy

    def __str__(self) -> str:
        return (f"transformers {self.installed} is outside the range patchset {self.patchset!r} is verified on "
                f"(transformers{self.spec})")
