"""The declaration that explains a foreign patch's numbers: which of ours it computes, and which the original does.

Why: "differs by 3.4" tells a user that something is wrong, not what. Every op the engine
knows offers the declarations that could replace a module or function (:meth:`ModuleOp.candidates`,
:meth:`FunctionOp.candidates`: a norm's ``scale`` and ``cast``, an MLP's activation and
projections, a rope's layout), each with a torch reference. Run on the module's recorded
inputs, the ones bit-equal to the original's output are what the original computes; the one
closest to the patched output is what the patch computes. Where they differ, that is the
explanation: ``computes scale: weight where the original computes scale: one_plus_weight``.

"Closest" is by the mean absolute difference (then the largest): a kernel that rounds once
where the reference rounds twice differs from it in the last bit of a few elements, while
another cast order or scale differs in many.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.ops.base import FunctionOp, ModuleOp, all_ops
from engine.runtime.hub_functions import torch_body
from engine.verification.compare import clone_tensors, tensors_of
from engine.verification.random_state import same_draws

__all__ = ["Explanation", "explain_function", "explain_module"]

#: Keys of a declaration that say where to patch and how to run, not what is computed.
_PLACE = {"kernel", "optional", "target", "function", "signature", "when"}
#: Projection and attribute names: shown only when they are what differs.
_WIRING = {"gate_proj", "up_proj", "down_proj", "gate_up_proj", "act_attr", "eps_attr", "weight_attr"}


@dataclass
class Explanation:
    """What the original computes and what the patch computes, as declarations of our ops."""

    original: str | None      # the declaration bit-equal to the original ("op: rms_norm, scale: weight, ...")
    patched: str | None       # the declaration closest to the patched output
    text: str                 # one sentence for the report
    another: bool             # the patch computes another declaration than the original (a finding)
    exact: bool = True        # the patch reproduces ``patched`` to the last bit (or one ulp of its dtype)
    keys: tuple[str, ...] = ()  # the settings in which ``patched`` differs from ``original``


#: Settings that say where a computation rounds, not what it computes: a finding in these alone, from a
#: kernel run by an emulator that rounds each op once, rests on that reading.
ROUNDING_KEYS = frozenset({"cast", "upcast", "precision"})


def _settings(patch: Any) -> dict[str, Any]:
    """What a declaration computes, the op first; defaults that say nothing here left out."""
    data = patch.model_dump(mode="json", exclude=_PLACE)
    if data.get("gate_up_proj") is None:
        data.pop("chunk_order", None)  # only a fused gate_up projection has halves to order
    if data.get("precision") == "native":
        data.pop("precision")
    ordered = {"op": data.pop("op")}
    ordered.update({k: v for k, v in data.items() if v is not None})
    return ordered


def describe(patch: Any, against: Any | None = None) -> str:
    """``op: X, key: value, ...``; with ``against``, only what differs from it (and the op)."""
    mine = _settings(patch)
    if against is None:
        return ", ".join(f"{k}: {v}" for k, v in mine.items() if k not in _WIRING)
    theirs = _settings(against)
    keys = [k for k in mine if mine[k] != theirs.get(k)]
    if mine["op"] != theirs["op"]:
        keys = ["op", *[k for k in keys if k != "op" and k not in _WIRING]]
    return ", ".join(f"{k}: {mine[k]}" for k in keys) or describe(patch)


def _distance(a: Any, b: Any) -> tuple[float, float]:
    """``(mean |a - b|, max |a - b|)`` over every tensor leaf; infinite where shapes or dtypes differ."""
    total, count, worst = 0.0, 0, 0.0
    for x, y in zip(tensors_of(a), tensors_of(b), strict=False):
        if not isinstance(y, torch.Tensor):
            continue
        if not isinstance(x, torch.Tensor) or x.shape != y.shape or x.dtype != y.dtype:
            return float("inf"), float("inf")
        d = (x.detach().double() - y.detach().double()).abs()
        if not bool(torch.isfinite(d).all()):
            return float("inf"), float("inf")
        total, count, worst = total + float(d.sum()), count + d.numel(), max(worst, float(d.max()) if d.numel() else 0.0)
    return (total / count if count else 0.0), worst


def within_ulp(a: Any, b: Any) -> bool:
    """Whether every element of ``a`` is within one ulp of ``b``'s (its dtype's spacing at ``b``'s magnitude)."""
    for x, y in zip(tensors_of(a), tensors_of(b), strict=False):
        if not isinstance(y, torch.Tensor):
            continue
        if not isinstance(x, torch.Tensor) or x.shape != y.shape or x.dtype != y.dtype:
            return False
        if not x.is_floating_point():
            if not torch.equal(x, y):
                return False
            continue
        yd = y.detach().double()
        tiny = torch.finfo(y.dtype).tiny
        spacing = torch.finfo(y.dtype).eps * torch.exp2(torch.floor(torch.log2(yd.abs().clamp_min(tiny))))
        if bool(((x.detach().double() - yd).abs() > spacing).any()):
            return False
    return True


def _own_error(expected: Any, truth: Any) -> float:
    worst = 0.0
    for o, t in zip(tensors_of(expected), tensors_of(truth), strict=False):
        if isinstance(o, torch.Tensor) and isinstance(t, torch.Tensor) and o.shape == t.shape:
            worst = max(worst, float((o.detach().double() - t.detach().double()).abs().max()) if o.numel() else 0.0)
    return worst


def _decide(outputs: list[tuple[Any, Any]], expected: Any, got: Any, owner: str,
            truth: Any = None) -> Explanation | None:
    """From ``(declaration, its output)`` pairs: what fits the original, what is closest to the patch.

    A declaration is said to be what the patch computes only where it reproduces the patch's output
    to the last bit or one ulp; otherwise the closest one is named with how far it still is, in units
    of the original's own error against fp64 (``truth``).
    """
    if not outputs:
        return None
    exact = [(p, o) for p, o in outputs if _distance(o, expected) == (0.0, 0.0)]
    near = sorted(outputs, key=lambda po: _distance(po[1], got))
    best, best_out = near[0]
    best_err = _distance(best_out, got)
    if best_err[0] == float("inf"):
        return None
    if not exact:
        return Explanation(None, describe(best), f"no declaration we know reproduces {owner} (closest to the patch: "
                                                 f"{describe(best)})", False, exact=False)
    mine, mine_out = min(exact, key=lambda po: _distance(po[1], got))
    mine_err = _distance(mine_out, got)
    if any(p is best for p, _ in exact) or not best_err[0] < 0.5 * mine_err[0]:
        if within_ulp(got, mine_out):
            return Explanation(describe(mine), describe(mine), f"computes what {owner} computes ({describe(mine)})",
                               False)
        noise = _own_error(expected, truth) if truth is not None else 0.0
        off = f"{mine_err[1] / noise:.2g}x the original's own error" if noise else f"max {mine_err[1]:.2g}"
        return Explanation(describe(mine), None, f"closest: {owner}'s own declaration ({describe(mine)}), still "
                                                 f"{off} off (more than one ulp)", False, exact=False)
    exactly = within_ulp(got, best_out)
    how = ("exactly" if best_err == (0.0, 0.0) else "to one ulp" if exactly else
           f"closest: mean difference {best_err[0]:.2g} from it, {mine_err[0]:.2g} from the original's")
    text = f"computes {describe(best, mine)} where {owner} computes {describe(mine, best)} ({how})"
    keys = tuple(part.split(":", 1)[0] for part in describe(best, mine).split(", "))
    return Explanation(describe(mine), describe(best), text, True, exact=exactly, keys=keys)


def explain_module(module: nn.Module, args: Any, kwargs: Any, expected: Any, got: Any,
                   truth: Any = None) -> Explanation | None:
    """The explanation for one module: every op's candidate declarations, run on ``module`` (the unpatched one)."""
    outputs = []
    for op, patch in _module_candidates(module):
        try:
            with torch.no_grad(), same_draws(module):
                out = op.bind(module, patch, op.reference(patch))(module, *clone_tensors(args), **clone_tensors(kwargs))
        except Exception:  # noqa: BLE001, S112  (a declaration that cannot run on this module explains nothing)
            continue
        outputs.append((patch, out))
    return _decide(outputs, expected, got, f"{type(module).__name__}.forward", truth)


def _module_candidates(module: nn.Module) -> Iterator[tuple[ModuleOp, Any]]:
    for op in all_ops().values():
        if isinstance(op, ModuleOp) and not op.opt_in:
            try:
                yield from ((op, p) for p in op.candidates(module))
            except Exception:  # noqa: BLE001, S112  (an op that cannot enumerate this module offers nothing)
                continue


def explain_function(name: str, original: Callable[..., Any], args: Any, kwargs: Any, expected: Any,
                     got: Any, truth: Any = None) -> Explanation | None:
    """The explanation for one module-level function: every function op's candidate declarations."""
    outputs = []
    body = torch_body(original)
    for op in all_ops().values():
        if not isinstance(op, FunctionOp):
            continue
        try:
            candidates = list(op.candidates(name, body))
        except Exception:  # noqa: BLE001, S112  (an op that cannot read this function offers nothing)
            continue
        for patch in candidates:
            try:
                with torch.no_grad():
                    out = op.reference(patch)(*clone_tensors(args), **clone_tensors(kwargs))
            except Exception:  # noqa: BLE001, S112
                continue
            outputs.append((patch, out))
    return _decide(outputs, expected, got, name, truth)
