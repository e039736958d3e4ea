"""Human- and machine-readable accounts of what a plan decided and what apply did."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.planning.decisions import Decision, Plan, format_decisions, format_table, from_files

__all__ = ["Report", "format_decisions", "format_table", "from_files"]


@dataclass
class Report:
    """What apply did: per module, the op, the kernel and why; what was skipped and why."""

    patchset: str
    model_type: str
    device: str
    mode: str
    decisions: tuple[Decision, ...]
    verification: Any = field(default=None)
    #: The files the patchset was read from, as absolute paths (its own first, then ``extends``
    #: bases); empty for a patchset given as a dict or built in Python.
    files: tuple[str, ...] = ()
    #: Outside the patchset's verified transformers range (``Plan.release``): what was done about it,
    #: the self-verification's verdict (:class:`engine.releases.ReleaseVerdict`) or, trusted, the
    #: :class:`~engine.foundation.release_policy.OutsideRange` itself; ``None`` inside the range.
    release: Any = None
    #: ``engine.apply(model)`` with no patchset: what zero configuration chose, measured, verified and left
    #: unpatched, and why (:class:`engine.zeroconfig.ZeroConfigReport`); ``None`` when a patchset was named.
    zero_config: Any = None
    #: What was checked on the model's own modules after patching, original vs patched at a few lengths, and
    #: what was not and why (:class:`engine.verification.real_modules.RealModules`); ``None``: not run.
    real_modules: Any = None

    @classmethod
    def from_plan(cls, plan: Plan) -> Report:
        return cls(
            plan.patchset.name, plan.model_type, plan.device.value, plan.mode, plan.decisions,
            files=plan.patchset.files, release=plan.release,
        )

    @property
    def file(self) -> str | None:
        """The patchset file actually applied (absolute), so a local copy and the bundled one are told apart."""
        return self.files[0] if self.files else None

    @property
    def patched(self) -> list[str]:
        return [d.path for d in self.decisions if d.action == "patch"]

    @property
    def skipped(self) -> list[tuple[str, str]]:
        return [(d.path, d.reason) for d in self.decisions if d.action == "skip"]

    @property
    def compile_disabled(self) -> list[str]:
        """Patched paths whose kernel is not torch.compile-safe, so it runs eagerly (a graph break)."""
        return [
            d.path
            for d in self.decisions
            if d.action == "patch" and d.provider is not None and not d.provider.compile_safe
        ]

    @property
    def fullgraph_blocker(self) -> str | None:
        """Why ``torch.compile(fullgraph=True)`` cannot hold the patched model, or None when it can.

        A kernel that is not compile-safe runs eagerly between graphs, which ``fullgraph=True``
        forbids; apply then sets ``_can_compile_fullgraph = False`` on the model's instances
        (transformers' flag), and revert restores it.
        """
        kernels = sorted({d.kernel or "-" for d in self.decisions if d.path in self.compile_disabled})
        if not kernels:
            return None
        return (f"kernels {', '.join(kernels)} are not torch.compile-safe and run eagerly between graphs, so "
                "fullgraph=True cannot compile this model: its _can_compile_fullgraph is False until revert")

    def to_dict(self) -> dict[str, Any]:
        return {
            "patchset": self.patchset,
            "file": self.file,
            "files": list(self.files),
            "model_type": self.model_type,
            "device": self.device,
            "mode": self.mode,
            "decisions": [
                {"path": d.path, "class": d.cls, "op": d.op, "kernel": d.kernel, "action": d.action, "reason": d.reason,
                 "sub_model": d.sub_model}
                for d in self.decisions
            ],
            "compile_disabled": self.compile_disabled,
            "fullgraph_blocker": self.fullgraph_blocker,
            "release": _release_dict(self.release),
            "zero_config": self.zero_config.to_dict() if self.zero_config is not None else None,
            "real_modules": self.real_modules.to_dict() if self.real_modules is not None else None,
        }

    def summary_line(self) -> str:
        """The one line a launcher shows at its default log level: what was patched, with what, and verified or not.

        ``patch-engine: patchset 'qwen3' on qwen3 (cpu, training): 12 patched, 0 skipped; kernels rms_norm:
        torch x9, swiglu: torch x2, rope: torch x1; verification passed (47 checks, 1.3 s)``.
        """
        kernels: dict[tuple[str, str], int] = {}
        for d in self.decisions:
            if d.action == "patch":
                kernels[(d.op, d.kernel or "-")] = kernels.get((d.op, d.kernel or "-"), 0) + 1
        used = ", ".join(f"{op}: {kernel} x{n}" for (op, kernel), n in kernels.items()) or "none"
        verification = self.verification
        release = f"; {_release_line(self.release)}" if self.release is not None else ""
        first = self.release if getattr(self.release, "passed", None) is True else None  # the gate's own verification
        if verification is None and first is not None:
            when = f"verdict read from {first.cache_file}" if first.cached else f"{first.seconds} s; {first.where()}"
            verified = f"verified first on a {first.model}: passed ({first.checks} checks, {when})"
            release = f"; why: {first.subject()}"
        elif verification is None:
            verified = "not verified (turn verification on to check the numbers before training)"
        else:
            verdict = "passed" if verification.passed else f"FAILED ({len(verification.failures)} checks)"
            verified = f"verification {verdict} ({len(verification.checks)} checks, {verification.seconds} s)"
        if self.zero_config is not None:
            release += f"; {self.zero_config.summary()}"
        return (f"patch-engine: patchset {self.patchset!r} on {self.model_type} ({self.device}, {self.mode}): "
                f"{len(self.patched)} patched, {len(self.skipped)} skipped; kernels {used}; {verified}{release}")

    def table(self, *, detail: bool = False) -> str:
        return format_decisions(self.decisions, detail=detail)

    def __str__(self) -> str:
        n = len(self.patched)
        head = (
            f"patchset {self.patchset!r}{from_files(self.files)} on {self.model_type} ({self.device}, {self.mode}): "
            f"{n} patched, {len(self.skipped)} skipped"
        )
        text = head + (f"\n{_release_line(self.release)}" if self.release is not None else "")
        text += f"\n{self.zero_config}" if self.zero_config is not None else ""
        text += (f"\n{self.real_modules}" if self.real_modules is not None else "") + "\n" + self.table()
        eager = self.compile_disabled
        if eager:
            text += (
                f"\nnot compile-safe, run outside torch.compile graphs (graph break): {len(eager)} "
                f"({', '.join(sorted({d.kernel or '-' for d in self.decisions if d.path in eager}))}); "
                "torch.compile(fullgraph=True) cannot hold it (_can_compile_fullgraph is False until revert)"
            )
        return text


def _release_line(release: Any) -> str:
    """One line on the release: a verdict says itself; a trusted release says it was not verified."""
    if getattr(release, "policy", None) == "trust":
        return f"{release}: patched without verifying it there (unverified='trust')"
    done = getattr(release, "done", None)  # a content not known verified, trusted (engine.releases.known)
    return done() if callable(done) else str(release)


def _release_dict(release: Any) -> dict[str, Any] | None:
    """``Report.release`` as data (a verdict's own ``to_dict``, or the fields of an ``OutsideRange``)."""
    if release is None:
        return None
    if hasattr(release, "to_dict"):
        return release.to_dict()
    from dataclasses import asdict

    return asdict(release)
