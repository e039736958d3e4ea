"""A self-verification's verdict: what was verified, where, on what, the result, and where it is kept.

Why a type of its own: the gate, the plan (a cached verdict says what apply will do), the report
(``report.release``) and the refusals all show it, and each must say the same thing.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

__all__ = ["ReleaseVerdict"]


@dataclass
class ReleaseVerdict:
    """The self-verification of one patchset on the installed release (fresh, or read from the cache).

    Made for content not known verified there: a release outside the patchset's range
    (``outside``), or content CI did not verify on it (a user's file, an edited bundled one).
    """

    patchset: str
    spec: str  # the patchset's requires.transformers ("" when it has none)
    installed: str  # the transformers release it was verified on
    passed: bool
    finding: str  # the verifier's failure message ("" when it passed)
    model: str  # what it ran on: "tiny qwen3 (Qwen3ForCausalLM)"
    device: str  # device kind (engine.releases.key.device_kind)
    dtype: str
    mode: str
    checks: int
    seconds: float  # how long the verification took (when it ran)
    verified_at: str  # UTC, ISO 8601
    source: str = ""  # what `patch-engine verify` takes for it (a bundled name, a quoted path; "" for a dict)
    cache_file: str | None = None  # where the verdict is kept (None: it could not be written)
    cached: bool = False  # read from the cache by this apply (no verification ran)
    model_type: str = ""  # the user's model type, the tiny model's
    why: str = ""  # why it was verified: not known verified content ("a patchset of your own (/abs/x.yaml)")
    outside: bool = False  # the installed release is outside the patchset's `requires`
    not_cached: str = ""  # why it was not written (the cache folder untrusted, or not writable)

    @classmethod
    def from_entry(cls, stored: dict[str, Any], **extra: Any) -> ReleaseVerdict:
        """A verdict from a cache entry's ``verdict`` (fields this version does not know are left out)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in stored.items() if k in known}, **extra)

    def where(self) -> str:
        if self.cache_file:
            return f"cached in {self.cache_file}"
        return f"not cached ({self.not_cached or 'the cache folder is not writable'})"

    def summary(self) -> str:
        """``tiny qwen3 (Qwen3ForCausalLM), cpu, fp32, training: 27 checks in 6.1 s``."""
        return f"{self.model}, {self.device}, {self.dtype}, {self.mode}: {self.checks} checks in {self.seconds} s"

    def subject(self) -> str:
        """What was verified and why: the release outside the range, or content not known verified."""
        if self.outside:
            return (f"patchset {self.patchset!r} is verified on transformers{self.spec}; installed {self.installed} is "
                    "outside that range")
        return (f"patchset {self.patchset!r}, {self.why or 'not bundled content'}, is not content CI verified on "
                f"transformers {self.installed}")

    def __str__(self) -> str:
        result = "passed" if self.passed else "FAILED"
        how = (f"verified there at {self.verified_at}: {result} ({self.summary()}); verdict read from {self.cache_file}"
               if self.cached else f"verified there first: {result} ({self.summary()}); verdict {self.where()}")
        return f"{self.subject()}, so it was {how}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
