"""TRL's trainers and the fused head: refuse, with what to set, where the head cannot run.

Why: TRL's trainers do their own thing with a causal LM's head, and ``fused_cross_entropy``
would otherwise be either silently bypassed or crash deep inside TRL:

* trl >= 1.16 (``trl.trainer.utils.add_fused_lm_head``, checked on 1.16.0): after
  ``Trainer.__init__`` the trainer replaces ``model.forward`` with its own fused LM head and
  calls it with ``fused_lm_head=True``; that forward calls the backbone and reads
  ``lm_head.weight`` itself, so the patched forward never runs in training (TRL's head already
  avoids the full logits). The same happens with ``SFTConfig(loss_type="chunked_nll")`` in the
  1.x releases that have it (1.5 to 1.13 checked).
* trl 0.29 (and 1.x with the default loss, up to 1.13 checked): ``SFTTrainer.compute_loss`` calls
  the model with ``labels`` and then reads ``outputs.logits`` every step (entropy, token
  accuracy), which the fused head returns as ``None``.

Nothing here imports TRL: TRL is recognised by where its code lives (the ``trl`` package), at
three points, each before anything is computed: planning a fused head on a model whose forward
TRL already replaced (:func:`check_not_replaced`), a training forward of the backbone called
by TRL rather than by the patched forward (:func:`refuse_trl_bypass`, a pre-hook the fused head
puts on the backbone), and a fused training forward called from a TRL trainer
(:func:`refuse_trl_caller`). ``PatchsetCallback`` refuses earlier still, from the trainer's
arguments (:func:`trl_trainer_conflict`).
"""

from __future__ import annotations

import sys
from importlib import metadata
from types import FrameType
from typing import Any

import torch
from torch import nn

from engine.errors import TrainerConflict

__all__ = ["check_not_replaced", "refuse_trl_bypass", "refuse_trl_caller", "trl_trainer_conflict"]

_DROP = ("drop fused_cross_entropy (engine.apply(..., fused_cross_entropy=False), or leave it out of "
         "PatchsetCallback); the other patches of the patchset still apply")
_MAX_FRAMES = 40  # TRL's compute_loss is ~10 frames above the forward (Trainer, accelerate, peft)


def _trl_version() -> str:
    try:
        return metadata.version("trl")
    except metadata.PackageNotFoundError:  # pragma: no cover - TRL code running without its metadata
        return "?"


def _is_trl(frame_or_fn: Any) -> bool:
    globals_ = getattr(frame_or_fn, "f_globals", None) or getattr(frame_or_fn, "__globals__", {})
    name = globals_.get("__name__", "")
    return name == "trl" or name.startswith("trl.")


def _where(frame: FrameType) -> str:
    return f"{frame.f_code.co_qualname} ({frame.f_code.co_filename}:{frame.f_lineno})"


def _bypass_message(cls: str, where: str) -> str:
    return (f"trl {_trl_version()} computes the loss of {cls} with its own fused LM head ({where}): it calls the "
            "backbone and reads lm_head.weight itself, so the patched forward with fused_cross_entropy is never "
            "called in training. TRL's head already avoids materializing the full logits: " + _DROP)


def _logits_message(cls: str, where: str) -> str:
    return (f"trl {_trl_version()} reads outputs.logits after each training forward of {cls} (entropy and token "
            f"accuracy, from {where}), and the fused head returns logits=None in training. To train without the "
            f"full logits use TRL's own head: trl>=1.16 always does, trl 1.5-1.13 with "
            f"SFTConfig(loss_type='chunked_nll'); or " + _DROP)


def check_not_replaced(module: nn.Module) -> None:
    """Plan time: refuse a fused head on a model whose forward TRL's trainer has already replaced."""
    current = module.__dict__.get("forward")
    fn = getattr(current, "__func__", current)
    if fn is not None and _is_trl(fn):
        code = fn.__code__
        raise TrainerConflict(_bypass_message(type(module).__name__, f"{code.co_qualname} in {code.co_filename}"))


def refuse_trl_bypass(module: nn.Module, args: tuple[Any, ...]) -> None:
    """Forward pre-hook on the backbone of a fused-head model: TRL calling it directly means the head is bypassed.

    Only the backbone's direct caller counts (the frame that called the module, past
    ``nn.Module``'s own call frames): the patched forward calls it from transformers' code, a
    user's own code may call it too; TRL's fused LM head calls it from ``trl``. Training only,
    and never while compiling (dynamo cannot trace frame inspection; TRL does not compile it).
    """
    if not module.training or torch.compiler.is_compiling():
        return
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") == nn.Module.__module__:
        frame = frame.f_back
    if frame is not None and _is_trl(frame):
        owner = frame.f_locals.get("self")
        raise TrainerConflict(_bypass_message(type(owner).__name__ if owner is not None else "the model", _where(frame)))


def refuse_trl_caller(model: nn.Module) -> None:
    """Before a fused training forward: refuse if a TRL trainer called it (TRL reads the logits it returns)."""
    if torch.compiler.is_compiling():
        return
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return
        if _is_trl(frame):
            raise TrainerConflict(_logits_message(type(model).__name__, _where(frame)))
        frame = frame.f_back


def trl_trainer_conflict(args: Any, model: nn.Module) -> str | None:
    """For ``PatchsetCallback``: why a fused head cannot run under the trainer these arguments are for, or None.

    Why from the arguments: ``on_init_end`` runs inside ``Trainer.__init__``, before a TRL trainer
    replaces the forward (trl >= 1.16) and before the first step reads the logits (0.29), and
    its ``args`` is TRL's config (``SFTConfig``, ``DPOConfig``, ...), so the refusal comes before
    anything is patched.
    """
    if not type(args).__module__.startswith("trl."):
        return None
    cls = type(model).__name__
    utils = sys.modules.get("trl.trainer.utils")
    if utils is not None and hasattr(utils, "add_fused_lm_head"):
        return _bypass_message(cls, f"trl.trainer.utils.add_fused_lm_head, installed by {type(args).__name__}'s trainer")
    return _logits_message(cls, f"the compute_loss of {type(args).__name__}'s trainer")
