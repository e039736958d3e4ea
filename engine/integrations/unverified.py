"""The ``unverified`` setting as each launcher takes it: its name or its old one, checked where it is written.

Why one helper: the docs say one setting, ``unverified`` (``verify``, ``refuse``, ``trust``),
decides everywhere, and each entry point that takes a patchset (the ``Trainer`` callback, the
launchers' plugins) takes it under that name and under its first one, ``unverified_release``;
both given and different is an error, and a bad value fails when the callback or config is
made, not at step 1. Unset, ``$PATCH_ENGINE_UNVERIFIED`` decides (:mod:`engine.foundation.release_policy`).
"""

from __future__ import annotations

from engine.foundation.release_policy import either, resolve_policy

__all__ = ["unverified_setting"]


def unverified_setting(unverified: str | None, unverified_release: str | None, *, where: str) -> str | None:
    """The one value given under either name (``None``: neither), checked now; ``where`` names the setting's place.

    >>> unverified_setting("refuse", None, where="PatchsetCallback")
    'refuse'
    """
    value = either(unverified, unverified_release, where=f"{where}: ")
    if value is not None:
        name = "unverified" if unverified is not None else "unverified_release"
        resolve_policy(value, setting=f"{where}({name}=...)")
    return value
