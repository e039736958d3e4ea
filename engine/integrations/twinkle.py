"""twinkle (``twinkle-kit``): a patchset as a twinkle ``Patch``, and as a ``kernelize`` mapping entry.

twinkle changes models through two documented doors, and a patchset fits both:

* ``TransformersModel.apply_patch(patch)`` calls ``patch(model)``; ``twinkle.patch.apply_context``
  calls ``patch.unpatch(model)`` on exit. :class:`PatchsetPatch` is a ``twinkle.patch.Patch``
  whose call is :func:`engine.apply` (for training) and whose ``unpatch`` is :func:`engine.revert`::

      model = TransformersModel(model_id="Qwen/Qwen3-0.6B")
      model.apply_patch(PatchsetPatch("qwen3", verify=True))

  (``model.apply_patch(PatchsetPatch, patchset="qwen3")`` works too: twinkle builds the class
  with no arguments and passes the keywords to the call.)
* ``twinkle.kernel.kernelize(model, mapping)`` installs a mapping of targets to kernel choices,
  each through an installer. :func:`kernel_mapping` returns one entry, ``{"patch_engine":
  KernelChoice(...)}``, whose installer applies the patchset; use it *instead of* the default
  mapping's entries for the same family (both would replace the same modules)::

      kernelize(model.model, kernel_mapping("qwen3"))

The patchset is loaded when the patch or the entry is made, so a misspelt name fails there,
before any model is touched (``kernelize`` would otherwise log a failed load and go on).

Why the fused head is refused: twinkle's ``TransformersModel.forward`` takes the labels out of
the batch and computes log-probabilities from ``outputs['logits']`` itself; it fuses the head
with Liger through its own ``task='fused_lm_ce'``. The engine's fused head would never see
labels, so ``fused_cross_entropy=True`` is refused and patchsets are applied without it.

What a twinkle run shows: the report's one line at INFO through twinkle's own logger
(``twinkle.get_logger()``: ``[INFO:twinkle] patch-engine: ...`` on stderr, its default level, local
rank 0 only), the full report at DEBUG (``LOG_LEVEL=DEBUG``).
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidArgument, TrainerConflict
from engine.integrations.announce import announce
from engine.integrations.stack_import import import_stack_module

__all__ = ["PLUGIN_NAME", "kernel_mapping"]  # and PatchsetPatch, built on first use (see __getattr__)

#: The op, backend and logical target name of the kernelize entry.
PLUGIN_NAME = "patch_engine"
INSTALL = 'pip install "twinkle-kit==0.5.1"'

_classes: dict[str, type] = {}


def _twinkle(module: str) -> Any:
    """Import a twinkle module, or say what to install (or, installed, what failed to import)."""
    return import_stack_module(module, who="engine.integrations.twinkle", needs="twinkle (the twinkle-kit package)",
                               install=INSTALL)


def __getattr__(name: str) -> Any:
    """``PatchsetPatch`` subclasses twinkle's ``Patch``, so it is built on first use (importing twinkle takes seconds)."""
    if name != "PatchsetPatch":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    if name not in _classes:
        base = _twinkle("twinkle.patch.base").Patch
        _classes[name] = type(name, (_PatchsetPatchMixin, base), {"__module__": __name__, "__doc__": _PatchsetPatchMixin.__doc__})
    return _classes[name]


def _load(patchset: Any, fused_cross_entropy: Any) -> Any:
    """The patchset, loaded now (bad names fail here), and the fused head refused (see the module docstring)."""
    if fused_cross_entropy not in (None, False):
        raise TrainerConflict(
            "fused_cross_entropy cannot run under twinkle: TransformersModel.forward takes the labels out of the "
            "batch and computes log-probabilities from the logits itself; use twinkle's task='fused_lm_ce' (Liger)"
        )
    from engine.zeroconfig import is_zero_config

    if is_zero_config(patchset):  # None / "auto" / "measure": zero configuration when the model is at hand
        return patchset
    from engine.loader import load_patchset

    return load_patchset(patchset)


class _PatchsetPatchMixin:
    """A patchset as a twinkle ``Patch``: ``__call__`` applies it for training, ``unpatch`` reverts it.

    Args:
        patchset: a bundled name, a path, a dict or a ``Patchset``; ``None`` (or ``"auto"``): zero
            configuration (the bundled patchset of the model's ``model_type``, else declarations
            measured and verified on a tiny copy of the model: :mod:`engine.zeroconfig`).
        verify: compare every patched module with its original forward once, when applying.
        mode: ``"training"`` (default: kernels with a backward) or ``"inference"``.
        fused_cross_entropy: only ``None``/``False`` (see the module docstring).
        unverified: ``"verify"`` (default), ``"refuse"`` or ``"trust"``: what content not known verified
            on the installed transformers gets (:func:`engine.apply`); unset, ``$PATCH_ENGINE_UNVERIFIED``
            decides. ``unverified_release`` is its old name.

    Attributes:
        report: the :class:`engine.planning.report.Report` of the last apply (``None`` before).
    """

    def __init__(self, patchset: Any = None, *, verify: bool = False, mode: str = "training",
                 fused_cross_entropy: Any = None, unverified: str | None = None,
                 unverified_release: str | None = None) -> None:
        from engine.integrations.unverified import unverified_setting

        self.patchset = _load(patchset, fused_cross_entropy)
        self.unverified_release = unverified_setting(unverified, unverified_release, where="PatchsetPatch")
        self.verify = verify
        self.mode = mode
        self.report: Any = None

    def __call__(self, module: Any, *args: Any, **kwargs: Any) -> Any:
        """Apply to ``module`` (the HF model ``apply_patch`` hands over); keywords override the constructor's.

        Returns the :class:`engine.planning.report.Report`.
        """
        from engine.api import apply

        patchset = _load(kwargs.pop("patchset", None), kwargs.pop("fused_cross_entropy", None)) or self.patchset
        verify = kwargs.pop("verify", self.verify)
        mode = kwargs.pop("mode", self.mode)
        from engine.integrations.unverified import unverified_setting

        release = unverified_setting(kwargs.pop("unverified", None), kwargs.pop("unverified_release", None),
                                     where="PatchsetPatch") or self.unverified_release
        if kwargs or args:
            raise InvalidArgument(f"PatchsetPatch: unknown arguments {list(args)} {sorted(kwargs)}; "
                                  "it takes patchset, verify, mode, fused_cross_entropy, unverified")
        before = self.report
        self.report = apply(module, patchset, mode=mode, verify=verify,
                            fused_cross_entropy=False, unverified_release=release)
        if self.report is not before:  # applying again with nothing to change says nothing
            logger = _twinkle("twinkle.utils.logger").get_logger()
            announce(self.report, line=logger.info, detail=logger.debug)
        return self.report

    def unpatch(self, module: Any, *args: Any, **kwargs: Any) -> None:
        """Put the original forwards back (:func:`engine.revert`); a model that is not patched is left alone."""
        from engine.api import is_patched, revert

        if is_patched(module):
            revert(module)


def _register_op() -> None:
    """Register the ``patch_engine`` op with kernelize's registry (once); its one backend is always available."""
    registry = _twinkle("twinkle.kernel.registry")
    if PLUGIN_NAME not in registry._OPS:
        registry.register_op(PLUGIN_NAME, implementations={
            PLUGIN_NAME: registry.KernelImpl(load=lambda target: PLUGIN_NAME, available=lambda: (True, None)),
        })


class _Installer:
    """kernelize's installer for the entry: ``(model, target, impl)`` -> apply the patchset to ``model``."""

    def __init__(self, patch: Any) -> None:
        self.patch = patch
        self.__name__ = f"patch_engine({getattr(patch.patchset, 'name', None) or patch.patchset or 'auto'})"

    def __call__(self, model: Any, target: Any, impl: Any) -> bool:
        self.patch(model)
        return True


def kernel_mapping(patchset: Any = None, *, verify: bool = False, mode: str = "training",
                   fused_cross_entropy: Any = None, unverified: str | None = None,
                   unverified_release: str | None = None) -> dict[str, Any]:
    """A ``kernelize`` mapping with one entry that applies ``patchset`` (arguments as :class:`PatchsetPatch`).

    The entry's installer keeps the :class:`PatchsetPatch` it applies:
    ``mapping["patch_engine"].installer.patch.report`` is the report after ``kernelize``.
    """
    KernelChoice = _twinkle("twinkle.kernel").KernelChoice
    _register_op()
    patch = __getattr__("PatchsetPatch")(patchset, verify=verify, mode=mode, fused_cross_entropy=fused_cross_entropy,
                                         unverified=unverified, unverified_release=unverified_release)
    return {PLUGIN_NAME: KernelChoice(op=PLUGIN_NAME, backends=(PLUGIN_NAME,), installer=_Installer(patch))}
