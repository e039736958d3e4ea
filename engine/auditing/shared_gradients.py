"""A backward that writes into the gradient it was given, located by the whole model's own numbers.

Why: Liger's RMSNorm with ``in_place=True`` returns its input's gradient in the buffer of its output's
gradient. That is harmless where nothing else holds that buffer (a pre-norm: its output feeds attention
alone) and wrong where autograd hands the same buffer to a second branch: OLMo 2's post-norms sit inside
``residual + norm(attn(x))``, and an add passes one gradient tensor to both of its inputs, so the norm's
backward overwrites the residual's gradient before the residual branch reads it (twinkle 0.5.1 maps
OLMo 2 to Liger's norm with ``in_place=True``; Liger's own OLMo 2 patch passes ``in_place=False``).

A module backward check runs each module on a cotangent of its own, so it can only see *that* a module
writes into it (:attr:`engine.auditing.backward.BackwardResult.writes_gradient`). Whether that matters is
the whole model's question, asked here: the patched model runs once more with each such module's output
gradient copied before its backward sees it. If the gradients then pass, the write is the cause, and the
rows of those modules say so; if they still differ, something else is wrong too, and nothing is claimed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from engine.verification.compare import tensors_of
from engine.verification.results import Check

__all__ = ["locate_shared_gradient", "private_output_gradients"]


@contextlib.contextmanager
def private_output_gradients(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Within the block, each of ``modules`` gets a copy of its output's gradient (its backward may write into it)."""

    def copy_gradient(_module: nn.Module, _args: Any, out: Any) -> None:
        for t in tensors_of(out):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(lambda g: g.clone())

    handles = [m.register_forward_hook(copy_gradient) for m in modules]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def locate_shared_gradient(rows: list[Any], checks: list[Check], modules: dict[str, nn.Module],
                           rerun: Callable[[], list[Check]], grads_ratio: float | None) -> None:
    """Mark the writing modules' rows as the cause when the gradients pass with each writer's gradient its own.

    ``rows``: the audit's rows; those whose backward check saw a write name the classes to copy for (every
    changed module of such a class, sampled or not). ``checks``: the whole-model checks as measured;
    ``rerun``: the same checks run again (inside this module's context). Which of them matter is found by
    role (a module's attribute name: every layer's ``post_attention_layernorm`` is one role): each role's
    copy left out in turn, one rerun each, so a role whose write is harmless is not blamed.
    """
    failed = any(c.what.startswith("grads") and not c.passed for c in checks)
    classes = {row.cls for row in rows if row.writes_gradient}
    suspects = [row for row in rows if row.cls in classes and isinstance(modules.get(row.path), nn.Module)]
    if not failed or not suspects or not _grads_pass(rerun, [modules[r.path] for r in suspects]):
        for row in rows:  # nothing to locate, or the write is not the whole story: the finding stays unlocated
            if row.writes_gradient:
                row.note = (row.note + "; " if row.note else "") + (
                    "its backward writes into its output's gradient in place" + (
                        " (harmless in this model: the whole model's gradients pass)" if not failed else ""))
        return
    roles: dict[str, list[Any]] = {}
    for row in suspects:
        roles.setdefault(row.path.rsplit(".", 1)[-1], []).append(row)
    guilty = [role for role in roles if len(roles) == 1 or not _grads_pass(
        rerun, [modules[r.path] for other, members in roles.items() if other != role for r in members])]
    for role, members in roles.items():
        for row in members:
            if role not in guilty:
                row.note = (row.note + "; " if row.note else "") + (
                    "its backward writes into its output's gradient in place, harmless where it sits (nothing "
                    "else holds that gradient)")
                continue
            row.result, row.evidence, row.explanation = "differs", "in-place gradient", ""
            row.ratio = max(row.ratio or 0.0, grads_ratio or 0.0)
            row.note = ("its backward writes its input's gradient into its output's gradient in place, and where it "
                        "sits another branch holds that same gradient (a residual add hands one tensor to both "
                        "inputs), which it overwrites: with that gradient copied first, every gradient of the whole "
                        "model passes")


def _grads_pass(rerun: Callable[[], list[Check]], copied: list[nn.Module]) -> bool:
    with private_output_gradients(copied):
        again = rerun()
    return all(c.passed for c in again if c.what.startswith("grads"))
