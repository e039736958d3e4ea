"""What to do with a transformers release outside a patchset's verified range: ``verify``, ``refuse``, ``trust``.

Why a setting of its own: a patchset's ``requires.transformers`` says where the compatibility
matrix verified it, and the world releases monthly. Refusing every release past the range
turned the whole engine off the day transformers 5.25.0 came out, although 87 of the 89
bundled patchsets verified on it as they were. So the range is evidence, not a wall:

* ``verify`` (the default): the planner's structural checks run as always, then the engine
  verifies the patchset on the installed release itself (the tiny model of its type, the
  plan's device and kernels) and caches the verdict (:mod:`engine.releases`);
* ``refuse``: the release is refused (:class:`VersionMismatch`), as before 5.25;
* ``trust``: applied without verification, with a warning.

One setting, read the same way everywhere: the ``unverified_release=`` keyword of
``engine.apply`` / ``plan`` / ``verify``, the CLI's ``--unverified-release``, every
integration's config key, and, where none of those says, the environment variable
``PATCH_ENGINE_UNVERIFIED_RELEASE``. Torch-free.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from engine.errors import InvalidArgument

__all__ = ["ENV_VAR", "POLICIES", "OutsideRange", "Policy", "resolve_policy"]

Policy = Literal["verify", "refuse", "trust"]
POLICIES: tuple[Policy, ...] = ("verify", "refuse", "trust")
ENV_VAR = "PATCH_ENGINE_UNVERIFIED_RELEASE"
_MEANING = ("verify (default: verify the patchset on the installed release first, verdict cached), refuse "
            "(refuse the release), trust (apply without verifying, with a warning)")


def resolve_policy(value: str | None = None, *, setting: str = "unverified_release") -> Policy:
    """The policy: ``value`` if given, else ``$PATCH_ENGINE_UNVERIFIED_RELEASE``, else ``"verify"``.

    ``setting`` names where ``value`` came from (a keyword, a CLI flag, a config key), so that a
    bad value is reported where the user wrote it.

    Raises:
        InvalidArgument: the value (or the environment variable) is not one of :data:`POLICIES`.
    """
    if value is None or value == "":
        env = os.environ.get(ENV_VAR, "").strip()
        if not env:
            return "verify"
        value, setting = env, f"${ENV_VAR}"
    text = str(value).strip().lower()
    if text in POLICIES:
        return text  # type: ignore[return-value]
    raise InvalidArgument(f"{setting}={value!r} is not a policy for a transformers release outside a patchset's "
                          f"verified range; use one of: {_MEANING}")


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
