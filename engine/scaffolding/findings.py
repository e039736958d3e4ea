"""What the scaffold measured: one :class:`Measurement` per declaration, one :class:`Finding` per candidate.

The data types, below both the measuring (``engine.scaffolding``) and the rendering
(``engine.scaffolding.rendering``), so that neither imports the other's types back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DTYPES", "DTYPE_NAMES", "Finding", "Measurement"]

#: The dtypes every declaration is measured in: fp32, and bf16 where cast orders differ.
DTYPES = (torch.float32, torch.bfloat16)
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}


@dataclass
class Measurement:
    """One declaration measured against the original: worst max-abs error per dtype."""

    patch: Any
    errors: dict[str, float] = field(default_factory=dict)
    problem: str | None = None  # refused by the op's checks, or raised while running

    @property
    def exact(self) -> bool:
        return self.problem is None and len(self.errors) == len(DTYPES) and all(e == 0.0 for e in self.errors.values())


@dataclass
class Finding:
    """A candidate module class or function, and every declaration tried on it."""

    kind: str  # "module" or "function"
    name: str  # class name, or function name
    instances: int  # modules of the class (or call sites of the function) measured
    origin: str = ""  # the Python module the class (or function) is defined in
    measurements: list[Measurement] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)  # (op, why) for ops whose checks said no
    opt_in: list[str] = field(default_factory=list)  # opt-in ops that fit (reported, never written)
    note: str = ""  # why nothing could be measured (never called, ...)

    @property
    def exact(self) -> list[Measurement]:
        return [m for m in self.measurements if m.exact]

    @property
    def chosen(self) -> Measurement | None:
        """The one exact declaration; ``None`` when none is exact, several tie, or a note says why none may be."""
        exact = self.exact
        return exact[0] if len(exact) == 1 and not self.note else None
