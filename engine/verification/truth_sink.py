"""Where the fp64 truth's parameter gradients go: summed over a parameter's uses, measured, dropped.

Why a sink and not ``.grad``: an fp64 gradient of every parameter at once would be twice the
model in memory. Each use of a parameter in the truth run hands its fp64 gradient here; once
the last use has arrived, the caller measures it against the original's gradient and lets it
go, so only parameters with uses still outstanding hold an fp64 gradient (a tied embedding:
from the head's backward to the input lookup's). With ``on_part`` / ``on_done`` a large
linear layer's gradient (an LM head: 4.6 GiB in fp64 at Qwen3-8B's vocabulary) arrives a block
of rows at a time and is never whole; a tied embedding then waits only in the rows its lookups
touch (at most the batch's tokens).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

__all__ = ["GradientSink"]


class GradientSink:
    """Sums the fp64 gradient of each use of a parameter; calls ``on_complete(name, grad)`` after its last use."""

    def __init__(self, on_complete: Callable[[str, torch.Tensor], None], held: torch.device | None = None,
                 on_part: Callable[[str, slice | torch.Tensor, torch.Tensor], None] | None = None,
                 on_done: Callable[[str], None] | None = None):
        self.on_complete = on_complete
        #: where partial sums wait for a parameter's other uses (the host, for a model on an accelerator: a tied
        #: embedding's fp64 gradient waits there from the head's backward to the lookup's)
        self.held = held
        #: ``on_part(name, rows, values)``: final fp64 values of some rows of a gradient (a slice or row indices),
        #: then ``on_done(name)``. Given both, a large linear layer's gradient (an LM head's) is handed over a
        #: block of rows at a time and never exists whole (:meth:`receive_blocks`)
        self.on_part, self.on_done = on_part, on_done
        self.uses: dict[str, int] = {}
        self.arrived: dict[str, int] = {}
        self.partial: dict[str, torch.Tensor] = {}
        self._owned: set[str] = set()  # partial sums the sink made itself: safe to add into in place
        self.lookups: dict[str, list[torch.Tensor]] = {}  # ids of lookups whose row gradients are still to come
        self._rows: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # (sorted row ids, their fp64 partial sums)

    def used(self, name: str, ids: torch.Tensor | None = None) -> None:
        """One more use of ``name`` whose gradient will arrive; ``ids``: a lookup of these rows (:meth:`receive_rows`)."""
        self.uses[name] = self.uses.get(name, 0) + 1
        if ids is not None:
            self.lookups.setdefault(name, []).append(ids.detach().reshape(-1))

    def streams(self, name: str) -> bool:
        """Whether a dense gradient of ``name`` arriving now can be handed over in blocks (:meth:`receive_blocks`).

        Yes where nothing of it is held yet and every use still to come is a lookup of known rows:
        the rows no lookup touches are final as they arrive; the touched ones (at most the batch's
        tokens) wait in a small fp64 buffer for the lookups' rows.
        """
        if self.on_part is None or self.on_done is None or name in self.partial or name in self._rows:
            return False
        return self.uses.get(name, 0) - self.arrived.get(name, 0) - 1 == len(self.lookups.get(name, ()))

    def receive_blocks(self, name: str, rows: int, blocks: Iterator[tuple[int, torch.Tensor]]) -> None:
        """A dense gradient of ``rows`` rows as ``(first row, block)`` pairs (see :meth:`streams`)."""
        pending = self.lookups.get(name, [])
        touched = torch.cat(pending).unique() if pending else None  # sorted
        keep = mask = None
        if touched is not None:
            mask = torch.zeros(rows, dtype=torch.bool, device=touched.device)
            mask[touched] = True
        for start, block in blocks:
            stop = start + block.shape[0]
            if mask is None or not bool(mask[start:stop].any()):
                self.on_part(name, slice(start, stop), block)  # type: ignore[misc]
                continue
            here = mask[start:stop].to(block.device)
            free = (~here).nonzero().reshape(-1)
            if free.numel():
                self.on_part(name, free + start, block[free])  # type: ignore[misc]
            if keep is None:
                keep = block.new_zeros(touched.numel(), *block.shape[1:])  # type: ignore[union-attr]
            ids = here.nonzero().reshape(-1) + start
            keep[torch.searchsorted(touched.to(block.device), ids)] = block[ids - start]  # type: ignore[union-attr]
        self.arrived[name] = self.arrived.get(name, 0) + 1
        if touched is not None and keep is not None:
            self._rows[name] = (touched, keep)
        self._finish_rows(name)

    def receive(self, name: str, grad: torch.Tensor, owned: bool = False) -> None:
        """One use's gradient; ``owned``: nobody else holds ``grad``, so later uses may be added into it."""
        held = self.partial.pop(name, None)
        if held is None:
            total = grad
        elif name in self._owned:
            total = held.add_(grad.to(held.device))
        else:
            total, owned = held + grad.to(held.device), True
        self._settle(name, total, owned)

    def receive_rows(self, name: str, index: torch.Tensor, rows: torch.Tensor, shape: torch.Size) -> None:
        """One lookup's gradient as the rows it touched (``grad[index[i]] += rows[i]``): no dense copy per use."""
        pending = self.lookups.get(name)
        if pending:
            pending.pop()  # which of them does not matter: only their number and the rows they touch
        if name in self._rows:  # the dense part came in blocks: only the touched rows wait
            touched, keep = self._rows[name]
            keep.index_add_(0, torch.searchsorted(touched, index.to(touched.device)).to(keep.device),
                            rows.to(keep.device))
            self.arrived[name] = self.arrived.get(name, 0) + 1
            self._finish_rows(name)
            return
        held = self.partial.pop(name, None)
        if held is None or name not in self._owned:
            device = self.held if self.held is not None else rows.device
            held = torch.zeros(shape, dtype=rows.dtype, device=device) if held is None else held.clone()
        self._settle(name, held.index_add_(0, index.to(held.device), rows.to(held.device)), True)

    def _settle(self, name: str, total: torch.Tensor, owned: bool) -> None:
        self._owned.discard(name)
        self.arrived[name] = self.arrived.get(name, 0) + 1
        if self.arrived[name] >= self.uses.get(name, 0):
            self.on_complete(name, total)
        else:
            if self.held is not None and total.device != self.held:
                total, owned = total.to(self.held), True
            self.partial[name] = total
            if owned:
                self._owned.add(name)

    def _finish_rows(self, name: str) -> None:
        """After a blockwise gradient: once every use has arrived, the waiting rows are final too."""
        if self.arrived[name] < self.uses.get(name, 0):
            return
        touched, keep = self._rows.pop(name, (None, None))
        if touched is not None:
            self.on_part(name, touched, keep)  # type: ignore[misc]
        self.lookups.pop(name, None)
        self.on_done(name)  # type: ignore[misc]

    def flush(self) -> None:
        """Deliver parameters some of whose uses never reached the loss (their gradient is what arrived)."""
        for name in list(self.partial):
            self.on_complete(name, self.partial.pop(name))
        for name in list(self._rows):
            self.arrived[name] = self.uses.get(name, 0)
            self._finish_rows(name)
        self._owned.clear()
        self.lookups.clear()
