"""Train with a patchset under ms-swift: ``--external_plugins`` our plugin file, ``--callbacks patch_engine``.

::

    PATCH_ENGINE_PATCHSET=qwen3 PATCH_ENGINE_VERIFY=1 swift sft --model ... --dataset ... \\
        --external_plugins "$(python -m engine.integrations.ms_swift --plugin-path)" \\
        --callbacks patch_engine

Why this shape: ms-swift's only hooks for user code are ``--external_plugins FILE.py`` (files it
imports while parsing the arguments; it wants a *path*, not a module name) and ``--callbacks
NAME`` (names looked up in ``swift.callbacks.callbacks_map`` and handed to its ``Trainer``); its
argument parser refuses flags it does not know, so our settings come from the environment:

* ``PATCH_ENGINE_PATCHSET``: a bundled name or a patchset path; unset or ``auto``: zero configuration
  (the bundled patchset of the model's ``model_type``, ``qwen3`` for a Qwen3 checkpoint, else
  declarations measured and verified on a tiny copy of the model: :mod:`engine.zeroconfig`).
* ``PATCH_ENGINE_VERIFY``: ``1``/``true`` (verify every patched module against its original once,
  before step 1), ``sample``, or ``0``/``false`` (the default).
* ``PATCH_ENGINE_FUSED_CROSS_ENTROPY``: ``1``/``true`` or ``0``/``false`` (unset: the patchset's key).
* ``PATCH_ENGINE_UNVERIFIED``: ``verify`` (the default), ``refuse`` or ``trust``: what content not
  known verified on the installed transformers gets (the engine's own variable;
  ``PATCH_ENGINE_UNVERIFIED_RELEASE``, its old name, still works).

The plugin file (``engine/integrations/ms_swift_plugin/patch_engine_swift.py``) registers :class:`SwiftPatchsetCallback`
under ``patch_engine``; ms-swift builds it with ``(args, trainer)`` as it builds its trainer, and
the callback patches the trainer's model at ``on_init_end``: after ms-swift's LoRA wrapping,
before ``train()`` wraps the model and before step 1, so a refusal stops the run before any step. The
settings are read (and the patchset loaded) when the plugin file is imported, so a misspelt
name stops ``swift sft`` at argument parsing, before the model loads.

What ``swift sft`` shows: the report's one line at INFO through ms-swift's own logger
(``swift.utils.get_logger()``: ``[INFO:swift] patch-engine: ...`` on stderr, ms-swift's default level,
local rank 0 only), the full report at DEBUG (``LOG_LEVEL=DEBUG``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import InvalidArgument
from engine.integrations.announce import announce
from engine.integrations.stack_import import import_stack_module
from engine.integrations.transformers import PatchsetCallback

__all__ = ["CALLBACK_NAME", "Settings", "SwiftPatchsetCallback", "plugin_path", "register"]

#: The ``--callbacks`` name the plugin file registers.
CALLBACK_NAME = "patch_engine"
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


@dataclass(frozen=True)
class Settings:
    """The patchset and options, read from ``PATCH_ENGINE_*`` environment variables."""

    patchset: str | None = None
    verify: bool | str = False
    fused_cross_entropy: bool | None = None
    unverified_release: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read and check the variables; a bad value is an :class:`InvalidArgument` naming the variable."""
        env = os.environ if environ is None else environ
        patchset = env.get("PATCH_ENGINE_PATCHSET") or None
        verify_text = env.get("PATCH_ENGINE_VERIFY", "").strip().lower()
        verify: bool | str = "sample" if verify_text == "sample" else _flag("PATCH_ENGINE_VERIFY", verify_text)
        fused_text = env.get("PATCH_ENGINE_FUSED_CROSS_ENTROPY")
        fused = None if fused_text is None else _flag("PATCH_ENGINE_FUSED_CROSS_ENTROPY", fused_text.strip().lower())
        from engine.foundation.release_policy import ENV_VARS, resolve_policy

        given = [name for name in ENV_VARS if env.get(name, "").strip()]  # the engine's order: the new name first
        release_text = env[given[0]].strip() if given else None
        if given:
            resolve_policy(release_text, setting=given[0])  # a typo stops here too
        from engine.zeroconfig import is_zero_config

        if not is_zero_config(patchset):
            from engine.loader import load_patchset

            load_patchset(patchset)  # a misspelt name or a schema error stops here, before the model loads
        return cls(patchset, verify, fused, release_text)


def _flag(name: str, text: str) -> bool:
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise InvalidArgument(f"{name}={text!r}: expected 1/true or 0/false"
                          + (" or sample" if name == "PATCH_ENGINE_VERIFY" else ""))


class SwiftPatchsetCallback(PatchsetCallback):
    """A :class:`PatchsetCallback` in ms-swift's callback shape, built with ``(args, trainer)``.

    ms-swift builds its callbacks *before* calling ``transformers.Trainer.__init__`` (so that
    ``on_init_end`` reaches them), when ``trainer.model`` does not exist yet; the patching
    therefore happens at ``on_init_end`` as in :class:`PatchsetCallback`, on the model the
    trainer holds (ms-swift's LoRA wrapping done), before ``train()`` and step 1.

    Attributes:
        settings: what was read from the environment when the plugin file was imported.
    """

    settings: Settings = Settings()

    def __init__(self, args: Any, trainer: Any) -> None:
        super().__init__(self.settings.patchset, verify=self.settings.verify,
                         fused_cross_entropy=self.settings.fused_cross_entropy,
                         unverified_release=self.settings.unverified_release)
        self.args = args
        self.trainer = trainer

    def _announce(self, report: Any) -> None:
        """Through ms-swift's logger: the line at INFO (its default level), the report at DEBUG."""
        logger = _swift("swift.utils").get_logger()
        announce(report, line=logger.info, detail=logger.debug)


def _swift(module: str) -> Any:
    """Import an ms-swift module, or say what to install (or, installed, what failed to import)."""
    return import_stack_module(module, who=f"--callbacks {CALLBACK_NAME} (an ms-swift plugin)",
                               needs="ms-swift", install="pip install ms-swift (4.6.0 tested)")


def register(settings: Settings | None = None) -> None:
    """Register :class:`SwiftPatchsetCallback` as ``--callbacks patch_engine`` in ms-swift.

    Args:
        settings: the patchset and options; ``None`` reads ``PATCH_ENGINE_*`` from the environment.
    """
    callbacks_map = _swift("swift.callbacks").callbacks_map
    SwiftPatchsetCallback.settings = Settings.from_env() if settings is None else settings
    callbacks_map[CALLBACK_NAME] = SwiftPatchsetCallback


def plugin_path() -> Path:
    """The file to pass to ``swift sft --external_plugins``."""
    return Path(__file__).with_name("ms_swift_plugin") / "patch_engine_swift.py"


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m engine.integrations.ms_swift --plugin-path``: print the plugin file's path."""
    parser = argparse.ArgumentParser(prog="python -m engine.integrations.ms_swift", description=__doc__.split("\n")[0])
    parser.add_argument("--plugin-path", action="store_true", help="print the file for swift's --external_plugins")
    options = parser.parse_args(argv)
    if not options.plugin_path:
        parser.print_help()
        return 2
    print(plugin_path())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
