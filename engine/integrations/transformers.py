"""Training with a patchset under Hugging Face ``Trainer``: one line.

Either pass a callback::

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[PatchsetCallback("qwen3")])

or patch the model on the way in::

    trainer = Trainer(model=patch_for_training(model, "qwen3"), args=args, train_dataset=ds)

Why apply at ``on_init_end``: it runs inside ``Trainer.__init__``, before ``train()``
wraps the model (accelerate's FSDP/DDP, ``torch_compile=True``), so the kernels are in
place before sharding and before the first trace, which is the order that works (see
docs/training.md). ``on_train_begin`` applies again as a backstop (for a callback added
after construction, or a ``model_init`` that builds a fresh model in ``train()``);
applying the same patchset twice patches once. On a model the user already patched with the
same patchset (in eval mode, say) the callback re-plans it for training where the kernels
must change; a model patched with another patchset is refused (``AlreadyPatched``). The plan is always made for training
(kernels need a backward), on the device ``TrainingArguments`` trains on, whatever mode
the model happens to be in when the trainer is built (``from_pretrained`` returns it in
eval mode).

Under a TRL trainer (``SFTTrainer`` and the others, whose ``args`` is TRL's config), the fused
head is refused at ``on_init_end``, before anything is patched: TRL computes the head itself or
reads the logits (see :mod:`engine.ops.trl_head`); the other patches apply as usual.

What the user sees: the report's one line (:meth:`Report.summary_line`) is *printed* on the main
process when the model is patched. Why print: what a ``Trainer`` shows without any logging setup is
its progress bar and the logs it prints (``ProgressCallback``/``PrinterCallback`` write the loss
dicts to stdout); transformers' own logger stops at WARNING by default, and the patch is not a
warning. The full report goes to the logger ``transformers.patch_engine`` at INFO, under
transformers' root logger, so ``TrainingArguments(log_level="info")`` (or
``transformers.logging.set_verbosity_info()``) shows it; LlamaFactory sets that level itself.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn
from transformers import TrainerCallback

from engine.api import apply, is_patched, plan, revert
from engine.errors import TrainerConflict
from engine.integrations.announce import announce
from engine.ops.trl_head import trl_trainer_conflict
from engine.planning.report import Report
from engine.runtime.wrappers import unwrap
from engine.schema import Patchset

__all__ = ["PatchsetCallback", "patch_for_training"]

#: Under transformers' root logger: its verbosity (``log_level="info"``) shows the full report.
LOG = logging.getLogger("transformers.patch_engine")


def patch_for_training(model: nn.Module, patchset: Patchset | str | dict[str, Any] | None = None,
                       **apply_kwargs: Any) -> nn.Module:
    """Apply ``patchset`` to ``model`` for training and return the model (for ``Trainer(model=...)``).

    No patchset: zero configuration (:mod:`engine.zeroconfig`), as :func:`engine.apply(model) <engine.apply>`.

    Keyword arguments go to :func:`engine.apply` (``device``, ``verify``, ``fused_cross_entropy``,
    ``unverified``).
    """
    apply(model, patchset, mode="training", **apply_kwargs)
    return model


class PatchsetCallback(TrainerCallback):
    """A ``TrainerCallback`` that patches the trainer's model with a patchset.

    Args:
        patchset: a bundled name (``"qwen3"``), a path, a dict or a :class:`Patchset`; none (or
            ``"auto"``): zero configuration, the bundled patchset of the model's type, else
            declarations measured and verified on a tiny copy of the model (:mod:`engine.zeroconfig`).
        revert_on_end: put the original forwards back when training ends. Off by default:
            evaluation and prediction after ``train()`` then run with the same kernels as
            training, and checkpoints are unaffected either way (patching changes no
            parameter or state-dict key).
        verify: check every patched module against its original forward once, when applying.
        fused_cross_entropy: fuse the causal-LM head + loss (``True``, ``False``, or
            ``{kernel, chunk_size}``; ``None`` keeps the patchset's key), as Liger's
            ``fused_linear_cross_entropy=True``. See :mod:`engine.planning.fused_head`.
        unverified: ``"verify"`` (default), ``"refuse"`` or ``"trust"``: what content not known
            verified on the installed transformers gets (see :func:`engine.apply`); unset,
            ``$PATCH_ENGINE_UNVERIFIED`` decides. ``unverified_release`` is its old name.

    Attributes:
        report: the :class:`Report` of the last apply (``None`` before).
    """

    def __init__(
        self, patchset: Patchset | str | dict[str, Any] | None = None, *, revert_on_end: bool = False, verify: bool = False,
        fused_cross_entropy: Any = None, unverified: str | None = None, unverified_release: str | None = None,
    ):
        from engine.integrations.unverified import unverified_setting

        # a bad value fails when the callback is made, before training
        self.unverified_release = unverified_setting(unverified, unverified_release, where="PatchsetCallback")
        self.patchset = patchset
        self.revert_on_end = revert_on_end
        self.verify = verify
        self.fused_cross_entropy = fused_cross_entropy
        self.report: Report | None = None

    def _apply(self, args: Any, model: nn.Module | None) -> None:
        if model is None:
            return
        device = getattr(getattr(args, "device", None), "type", None)
        self._refuse_fused_head_under_trl(args, model, device)
        before = self.report
        self.report = apply(model, self.patchset, device=device, mode="training", verify=self.verify,
                            fused_cross_entropy=self.fused_cross_entropy, unverified_release=self.unverified_release)
        if self.report is not before:  # a repeat that changed nothing (on_train_begin) returns the same report
            self._announce(self.report)

    def _announce(self, report: Report) -> None:
        """The one line printed (what a Trainer user sees by default: see the module docstring), the report at INFO."""
        announce(report, line=lambda text: print(text, flush=True), detail=LOG.info)

    def _refuse_fused_head_under_trl(self, args: Any, model: nn.Module, device: str | None) -> None:
        """Refuse, before patching anything, a fused head under a TRL trainer (see :mod:`engine.ops.trl_head`)."""
        inner = unwrap(model)
        problem = trl_trainer_conflict(args, inner)
        if problem is None:
            return
        from engine.zeroconfig import resolve

        patchset = resolve(inner, self.patchset, device=device, mode="training",
                           fused_cross_entropy=self.fused_cross_entropy)
        if patchset is None:  # zero configuration found nothing to patch: no head either
            return
        the_plan = plan(inner, patchset, device=device, mode="training", fused_cross_entropy=self.fused_cross_entropy,
                        unverified_release=self.unverified_release)
        if any(d.op == "fused_linear_cross_entropy" for d in the_plan.patched):
            raise TrainerConflict(f"PatchsetCallback({the_plan.patchset.name!r}, fused_cross_entropy=...): {problem}")

    def on_init_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any) -> None:
        self._apply(args, model)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any) -> None:
        self._apply(args, model)

    def on_train_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any) -> None:
        if self.revert_on_end and model is not None and is_patched(model):
            revert(model)
