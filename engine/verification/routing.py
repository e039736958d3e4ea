"""A router's choice of experts, recorded in the original's run and pinned in the patched one.

Why: an MoE router picks each token's experts with ``topk`` over its scores. Two scores within
rounding of each other are a tie that any other rounding may break the other way: a bf16 kernel
that is correct to its last bit upstream (an RMSNorm that rounds once where the original rounds
twice) sends 2 of 192 routed rows to other experts (solar_open, bf16). Each such row's
whole contribution then moves from one expert's gradient to another's, far beyond any rounding
rule, and the verifier failed a correct patchset. Such a flip says nothing about the kernel.

So when a whole-model check of a model that routes fails, it is run again with the patched
model's ``topk`` results replaced, call by call, by the original's indices (their values gathered
from the patched scores, so gradients still flow through the patched router); a kernel that is
wrong still fails there, on the same routing. The report says how many rows chose otherwise.
``topk`` is seen by a :class:`torch.overrides.TorchFunctionMode` entered around those two runs
only (never in the first judgement: it costs a Python call per torch op).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["RoutingLog", "judged_with_routing_pinned", "routes"]

_TOPK = (torch.topk, torch.Tensor.topk)
_ROUTER_WORDS = ("moe", "expert", "router", "switch", "sparse")


def routes(model: nn.Module) -> bool:
    """Whether ``model`` has a module whose class names routing (MoE blocks, experts, routers): worth a retry."""
    return any(any(w in type(m).__name__.lower() for w in _ROUTER_WORDS) for m in model.modules())


class _Mode(TorchFunctionMode):
    def __init__(self, log: RoutingLog, pin: bool) -> None:
        super().__init__()
        self.log, self.pin, self.calls = log, pin, 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func not in _TOPK:
            return out
        index, self.calls = self.calls, self.calls + 1
        if not self.pin:
            self.log.chosen.append(out.indices.detach().clone())
            return out
        if index >= len(self.log.chosen) or self.log.chosen[index].shape != out.indices.shape:
            self.log.mismatched = True  # another sequence of calls: nothing to pin to
            return out
        want = self.log.chosen[index].to(out.indices.device)
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        moved = (want.sort(dim).values != out.indices.sort(dim).values).any(dim)
        self.log.tokens += moved.numel()
        self.log.flipped += int(moved.sum())
        gathered = args[0].gather(dim, want)
        if bool(moved.any()):  # how far apart the scores it chose and the original's choices are, in the patched run
            own = out.values.sort(dim, descending=True).values
            theirs = gathered.sort(dim, descending=True).values
            gap = ((own - theirs).abs().amax(dim) / args[0].abs().amax(dim).clamp_min(1e-30))[moved].detach()
            self.log.widest = max(self.log.widest, float(gap.max()))
        return torch.return_types.topk((gathered, want))


#: A moved row is a tie when the scores it chose and the original's choices are within this many machine epsilons of
#: the model's dtype, relative to the row's largest score (bf16: 6%; fp32: 1e-6). Measured: solar_open bf16's two
#: moved rows are 0.1% apart; a router that picks wrongly moves rows far apart, and most of them.
TIE_EPSILONS = 8
#: At most this share of the routed rows may move (at least one): a tie is rare; a wrong router moves many.
MOVED_AT_MOST = 0.05


class RoutingLog:
    """The original's ``topk`` indices, call by call (:meth:`recording`), pinned in another run (:meth:`pinning`).

    ``dtype``: the model's; what counts as a tie (:data:`TIE_EPSILONS`) is measured in its epsilon."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        self.tie = TIE_EPSILONS * torch.finfo(dtype).eps
        self.chosen: list[torch.Tensor] = []
        self.flipped = 0
        self.tokens = 0
        self.mismatched = False
        #: the widest gap, relative to its row's largest score, between what a moved row chose and the original's choice
        self.widest = 0.0

    def recording(self) -> _Mode:
        return _Mode(self, pin=False)

    def pinning(self) -> _Mode:
        self.flipped = self.tokens = 0
        self.widest = 0.0
        return _Mode(self, pin=True)

    @property
    def ties(self) -> bool:
        """Every moved row a tie, and few of them: what pinning may judge past."""
        return (not self.mismatched and self.flipped > 0 and self.widest <= self.tie
                and self.flipped <= max(1, MOVED_AT_MOST * self.tokens))

    def note(self) -> str:
        return (f"routing pinned: {self.flipped} of {self.tokens} routed rows chose other experts in the patched run "
                "(a tie broken by rounding); judged again with the original's choices, the patched router's "
                "scores gathered at them")


def judged_with_routing_pinned(checks: list[Any], log: RoutingLog, again: Callable[[], list[Any]]) -> list[Any]:
    """``again()``'s checks (the patched run pinned to ``log``) where the routing moved, each with a note saying so;
    ``checks`` as they were where it did not move, cannot be pinned (another sequence of ``topk`` calls) or the
    pinned run raises (a forward that cannot run under the mode: the first judgement stands)."""
    try:
        pinned = again()
    except Exception:  # noqa: BLE001
        return checks
    if log.mismatched or not log.flipped:
        return checks
    if not log.ties:  # a router that chose otherwise, not a tie: the first judgement stands, with what moved
        for check in checks:
            check.note += (f" ({log.flipped} of {log.tokens} routed rows chose other experts in the patched run, "
                           f"scores up to {log.widest:.2g} of their row's largest apart: not a tie, judged as run)")
        return checks
    for check in pinned:
        check.note += f" ({log.note()})"
    return pinned
