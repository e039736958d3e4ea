"""What a plan decided: the decision types (Decision, FunctionSite, Plan) and their text tables.

Why a module of its own: the planner computes these and the report shows what apply did with
them; both import this module, so neither imports the other (types below, rendering above).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.foundation.release_policy import OutsideRange
from engine.kernels.registry import KernelProvider
from engine.planning.tables import TABLE_WIDTH, format_table
from engine.schema import Device, Patchset

__all__ = ["Action", "Decision", "FunctionSite", "Mode", "Plan", "format_decisions", "format_table", "from_files"]

Mode = Literal["training", "inference"]
Action = Literal["patch", "skip"]


@dataclass(frozen=True)
class FunctionSite:
    """Where a function patch takes effect: the namespace the callers resolve the name in."""

    namespace: str  # module name, e.g. transformers.models.qwen3.modeling_qwen3
    function: str
    callers: tuple[str, ...]  # module paths whose forward calls the function


@dataclass(frozen=True)
class Decision:
    """What happens to one module (or one function) under one patch."""

    path: str  # module path in the model, or "<namespace>.<function>"
    cls: str  # class name, or "function"
    op: str
    patch_index: int
    action: Action
    kernel: str | None
    reason: str
    patch: Any = field(repr=False, compare=False)
    provider: KernelProvider | None = field(default=None, repr=False, compare=False)
    site: FunctionSite | None = field(default=None, repr=False, compare=False)
    #: The nested pretrained model the module sits under (``model.visual``, ``model.language_model``),
    #: for a function the ones its callers sit under; ``""`` for the root (see engine.runtime.submodels).
    sub_model: str = ""


@dataclass(frozen=True)
class Plan:
    """The decisions for one model, device and mode. Pure data: applying it is the patcher's job."""

    patchset: Patchset
    device: Device
    mode: Mode
    model_type: str
    decisions: tuple[Decision, ...]
    #: Set when the installed transformers is outside the patchset's ``requires`` and the
    #: ``unverified_release`` policy let it through (:class:`engine.foundation.release_policy.OutsideRange`).
    release: OutsideRange | None = None
    #: What apply does about verification (``engine.plan`` sets it: :class:`engine.releases.known.VerificationPath`):
    #: none needed (bundled content CI verified on this release), a cached verdict of its own, verifies it first,
    #: trusts it, or refuses it. ``None`` where the planner was called directly (it reads no cache).
    verification: Any = None

    @property
    def patched(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.action == "patch")

    @property
    def skipped(self) -> tuple[Decision, ...]:
        return tuple(d for d in self.decisions if d.action == "skip")

    @property
    def file(self) -> str | None:
        """The patchset file planned from (absolute; its ``extends`` bases in ``patchset.files``); None for a dict."""
        return self.patchset.files[0] if self.patchset.files else None

    def __str__(self) -> str:
        head = (
            f"plan {self.patchset.name!r}{from_files(self.patchset.files)} "
            f"for {self.model_type} on {self.device.value} ({self.mode})"
        )
        notes = [note for note in (self.release_note(), self.verification) if note]
        return "\n".join([head, *map(str, notes), format_decisions(self.decisions)])

    def release_note(self) -> str | None:
        """What apply will do about a release outside the patchset's range (``None`` inside it)."""
        return f"{self.release}: {_RELEASE_ACTION[self.release.policy]}" if self.release else None


_RELEASE_ACTION = {
    "verify": "apply verifies the patchset on it first (a cached verdict where there is one)",
    "trust": "apply patches without verifying (unverified='trust')",
}


def from_files(files: Sequence[str]) -> str:
    """`` from /abs/qwen3.yaml`` (and `` (extends /abs/base.yaml)``); ``""`` for an in-memory patchset."""
    if not files:
        return ""
    text = f" from {files[0]}"
    if len(files) > 1:
        text += f" (extends {', '.join(files[1:])})"
    return text


def _grouped(decisions: Iterable[Decision], with_sub_model: bool) -> list[tuple[Any, ...]]:
    groups: dict[tuple[str, ...], int] = {}
    for d in decisions:
        # functions read as `modeling_qwen3.apply_rotary_pos_emb`, not the whole dotted module path
        target = d.cls if d.cls != "function" else ".".join(d.path.rsplit(".", 2)[-2:])
        key = ((d.sub_model or "-",) if with_sub_model else ()) + (target, d.op, d.kernel or "-", d.action, d.reason)
        groups[key] = groups.get(key, 0) + 1
    return [(*key[:-1], n, key[-1]) for key, n in groups.items()]


def _has_sub_models(decisions: Sequence[Decision]) -> bool:
    """Show the sub-model column only for composite models (more than one sub-model involved)."""
    return len({d.sub_model for d in decisions} - {"", "<root>"}) > 1


def format_decisions(decisions: Iterable[Decision], *, detail: bool = False) -> str:
    decisions = list(decisions)
    sub = _has_sub_models(decisions)
    first = ("sub-model",) if sub else ()
    if detail:
        return format_table(
            (*first, "module", "class", "op", "kernel", "decision", "why"),
            (((d.sub_model or "-",) if sub else ()) + (d.path, d.cls, d.op, d.kernel or "-", d.action, d.reason)
             for d in decisions),
        )
    return format_table((*first, "target", "op", "kernel", "decision", "modules", "why"), _grouped(decisions, sub),
                        width=TABLE_WIDTH)
