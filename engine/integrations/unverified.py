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


def unverified_setting(unverified: str | None, unverified_release: str | None, *, where: str,
                       keys: tuple[str, str] | None = None) -> str | None:
    """The one value given under either name (``None``: neither), checked now; ``where`` names the setting's place.

    ``keys``: the two names as a config file spells them, where the setting is a key of a file (LlamaFactory's
    ``kernel_config``, an axolotl YAML), not a keyword: the error then says ``WHERE: KEY='bad'`` (the key as the
    user wrote it), not ``WHERE(unverified=...)='bad'``.

    >>> unverified_setting("refuse", None, where="PatchsetCallback")
    'refuse'
    """
    value = either(unverified, unverified_release, where=f"{where}: ")
    if value is not None:
        first = unverified is not None
        if keys is not None:
            setting = f"{where}: {keys[0] if first else keys[1]}"
        else:
            setting = f"{where}({'unverified' if first else 'unverified_release'}=...)"
        resolve_policy(value, setting=setting)
    return value
