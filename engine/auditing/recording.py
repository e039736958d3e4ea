"""The original's per-module and per-function numbers, measured before any patch exists.

Why before: a foreign patch may change classes and module-level functions for the whole
process (Liger rebinds ``apply_rotary_pos_emb``; twinkle sets ``forward`` on classes), so an
"original" run after it could run patched code. Here every module of the model (but the
containers of its decoder layers, which the whole-model checks judge) and every module-level
function its forwards call is recorded in the original's own run: its first inputs, its output
on them (again, without a graph: what the patched module's output is compared with) and that
output evaluated in fp64 (:func:`engine.verification.fp64_truth`: the original's own rounding
error, the judge's yardstick). Nothing of a patch has run yet, so nothing of it can be in them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.runtime import routing
from engine.runtime.hub_functions import torch_body
from engine.verification.compare import clone_tensors, copy_cache, is_cache, move_tensors
from engine.verification.random_state import same_draws
from engine.verification.truth import fp64_truth

__all__ = ["Recorded", "containers", "measure", "recording"]


@dataclass
class Recorded:
    """One module's or function's first inputs in the original's run, its output on them, and their fp64 truth."""

    args: Any
    kwargs: Any
    expected: Any = None
    truth: Any = None
    problem: str | None = None  # the original itself could not be run again on its inputs (rare): why


def containers(model: nn.Module) -> set[str]:
    """Paths of the modules that hold two or more decoder layers (the model and its base model).

    Why: their numbers are the whole model's, judged by the logits, loss and gradient checks; a
    per-module record of them would be the model again. Decoder layers are the items of the
    module list holding the most parameters.
    """
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 1]
    if not lists:
        return {""}
    layers = max(lists, key=lambda m: sum(p.numel() for p in m.parameters()))
    blocks = {id(b) for b in layers}
    return {path for path, m in model.named_modules() if sum(id(x) in blocks for x in m.modules()) >= 2}


@contextlib.contextmanager
def recording(
    model: nn.Module, paths: set[str], functions: dict[tuple[str, str], Any], into: dict[Any, Recorded],
    held: torch.device | None,
) -> Iterator[None]:
    """While the block runs, the first inputs of each module in ``paths`` and each function in ``functions``.

    Modules by a forward pre-hook; functions by the router the engine's function patches use
    (:mod:`engine.runtime.routing`), installed for the block only and released after it, so
    nothing of it is left when a patch runs.
    """
    handles = []
    for path, module in model.named_modules():
        if path not in paths:
            continue

        def hook(_m: nn.Module, args: Any, kwargs: Any, _path: str = path) -> None:
            if _path not in into:  # a cache as it is now (the run goes on to fill it); tensors detached, not copied
                kept = {k: copy_cache(v) if is_cache(v) else v for k, v in kwargs.items() if k != "labels"}
                into[_path] = Recorded(*_held((args, kept), held))

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))

    def observer_for(key: tuple[str, str]) -> Callable[[Any, Any], None]:
        def observe(args: Any, kwargs: Any) -> None:
            if key not in into:  # copies: a function called next may work in place
                into[key] = Recorded(*_held((clone_tensors(args), clone_tensors(kwargs)), held))

        return observe

    try:
        with routing.observing(functions, observer_for):
            yield
    finally:
        for h in handles:
            h.remove()


def _held(value: tuple[Any, Any], held: torch.device | None) -> tuple[Any, Any]:
    args, kwargs = value
    detach = _detach
    return move_tensors(detach(args), held), move_tensors(detach(kwargs), held)


def _detach(value: Any) -> Any:
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, torch.Tensor.detach, value)


def measure(model: nn.Module, functions: dict[tuple[str, str], Any], into: dict[Any, Recorded]) -> None:
    """Each record's output (no graph, fixed draws) and its fp64 truth, from the original's code as it is now.

    Run before the patch: the forwards called here are the model's own, the functions the
    modeling modules' own (their torch bodies, where transformers bound a name to a package).
    """
    named = dict(model.named_modules())
    device = next(model.parameters()).device
    for key, rec in into.items():
        if isinstance(key, str):
            module = named[key]
            call: Callable[..., Any] = module.forward
            scope: nn.Module | None = module
        else:
            call, scope = torch_body(functions[key]), None
        args, kwargs = move_tensors(rec.args, device), move_tensors(rec.kwargs, device)
        try:
            with torch.no_grad(), same_draws(scope):
                rec.expected = call(*clone_tensors(args), **clone_tensors(kwargs))
            with torch.no_grad(), fp64_truth(scope), same_draws(scope):
                rec.truth = call(*clone_tensors(args), **clone_tensors(kwargs))
        except Exception as exc:  # noqa: BLE001  (the original's own forward on its own inputs: recorded, not fatal)
            rec.problem = f"the original could not be run again on its recorded inputs: {type(exc).__name__}: {exc}"
        rec.expected, rec.truth = _detach(rec.expected), _detach(rec.truth)
