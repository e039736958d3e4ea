"""Which way an apply goes: known verified content, a cached verdict, a verification first, trusted or refused.

The rule (issue 38): content patches without a self-verification only where it is *known verified
on the installed release*: a bundled patchset's content as CI verified it on this release (the
manifest, :mod:`engine.releases.manifest`), or a content with a passing verdict of its own in the
user's cache. Anything else (a user's file or dict, inside its ``requires`` range or not, an edited
bundled file, a bundled one on a release CI did not run) goes through the same gate as an
unverified release: verified first on a tiny model of the user's model type (policy ``verify``,
the default), refused (``refuse``) or trusted with a warning (``trust``).

:func:`verification_path` answers it for a model and its plan without changing anything (it
reads the cache, takes no lock, verifies nothing): ``engine.plan`` shows it, and the gate
(:class:`engine.releases.ReleaseGate`) acts on it. This is the public entry point for any
``Patchset`` object, wherever it came from (a file, a dict, zero configuration's measured
declarations): its content decides, never its name or the range it claims.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from engine.foundation.release_policy import Policy
from engine.kernels.triton_interpret import is_interpreting
from engine.planning.decisions import Plan
from engine.releases.code import code_not_verified, patched_code, shown
from engine.releases.key import device_kind, key_material, key_of, model_code
from engine.releases.manifest import column_text, content_sha256, installed_column, verified_columns
from engine.releases.self_verify import kernels_of
from engine.releases.verdict import ReleaseVerdict
from engine.runtime.release import is_bundled, verify_command
from engine.verification.compare import DTYPE_NAMES, floating_dtype

__all__ = ["Kind", "VerificationPath", "key_for", "model_dtype", "not_known_verified", "verification_path"]

#: ``bundled``: CI verified this content on this release; ``cached``: a verdict of its own is cached (passed or
#: failed); ``verify``: apply verifies it first; ``trust``: apply patches it unverified (a warning); ``refuse``:
#: apply refuses it unverified; ``nothing``: the plan patches nothing.
Kind = Literal["bundled", "cached", "verify", "trust", "refuse", "nothing"]


@dataclass(frozen=True)
class VerificationPath:
    """What applying a plan does about verification, and why (``str()`` is the plan's line)."""

    kind: Kind
    why: str = ""  # why the content is not known verified ("" for bundled / nothing)
    detail: str = ""  # bundled: the releases CI verified it on
    verdict: ReleaseVerdict | None = None  # cached: the verdict read
    source: str | None = None  # what `patch-engine verify` takes for the patchset (None: a dict)
    model_type: str = ""

    def __str__(self) -> str:
        if self.kind == "nothing":
            return "verification: nothing to patch, nothing to verify"
        if self.kind == "bundled":
            return f"verification: none needed, {self.detail}"
        if self.kind == "cached" and self.verdict is not None:
            v = self.verdict
            result = "passed, so apply patches" if v.passed else "FAILED, so apply refuses it"
            return (f"verification: a cached verdict of its own ({self.why}): verified on transformers {v.installed} "
                    f"at {v.verified_at}, {result} ({v.summary()}; {v.cache_file})")
        command = f"; patch-engine verify {self.source} shows every check" if self.source else ""
        if self.kind == "verify":
            return (f"verification: apply verifies it first ({self.why}): on a tiny {self.model_type} model of this "
                    f"release, its verdict then cached{command}")
        if self.kind == "trust":
            return f"verification: none ({self.why}): apply patches it without verifying (unverified='trust')"
        return (f"verification: apply refuses it ({self.why}) under unverified='refuse'; unverified='verify' (the "
                f"default) verifies it first{command}")

    def done(self) -> str:
        """What apply did, for a report (a trusted content: patched unverified)."""
        if self.kind == "trust":
            return f"{self.why}: patched without verifying it (unverified='trust')"
        return str(self)

    @property
    def known_verified(self) -> bool:
        """Whether apply patches without verifying anything now (bundled, a cached pass, or nothing to patch)."""
        return self.kind in ("bundled", "nothing") or (self.kind == "cached" and bool(self.verdict and
                                                                                        self.verdict.passed))


def model_dtype(model: nn.Module) -> torch.dtype:
    return floating_dtype(model.parameters())


def _device_index(model: nn.Module, device: str) -> int | None:
    return next((p.device.index for p in model.parameters() if p.device.type == device), None)


def key_for(model: nn.Module, plan: Plan) -> tuple[str, dict[str, Any]]:
    """The verdict's key and key material for applying ``plan`` to ``model`` (:mod:`engine.releases.key`)."""
    dtype = model_dtype(model)
    interpreted = plan.device.value == "cuda" and is_interpreting()
    kind = device_kind(plan.device.value, interpreted=interpreted, index=_device_index(model, plan.device.value))
    material = key_material(plan.patchset, device_kind=kind, dtype=DTYPE_NAMES.get(dtype, str(dtype)),
                            mode=plan.mode, kernels=kernels_of(plan), model_type=plan.model_type)
    code = model_code(model)
    if code is not None:  # a checkpoint's own modeling code: its content is part of what was verified
        material["model_code"] = code
    # the identity of the live code each patched class and function runs: a verdict is about this code, not about
    # a name or a version (a class rebound in a notebook, an edited install, a layer file edited between processes)
    material["code"] = patched_code(model, plan.patched)
    return key_of(material), material


def not_known_verified(plan: Plan, model: nn.Module | None = None) -> tuple[str | None, str]:
    """``(why it is not known verified, "")``, or ``(None, what CI verified)`` for bundled content verified here.

    With ``model``, bundled content is known verified only where every class and function the plan
    patches on it runs the code CI verified it on (:mod:`engine.releases.code`); without, the
    content and the release decide (a dry answer for callers that have no model).
    """
    sha = content_sha256(plan.patchset)
    name, columns = verified_columns(sha)
    here = installed_column()
    if name is not None and here in columns:
        differs = (code_not_verified(model, plan) if model is not None else None) or []
        if not differs:
            return None, (f"bundled content {name!r} as CI verified it on transformers {column_text(here)}, on the "
                          "code this model runs (engine/_data/verified_content.json)")
        return (f"bundled content {name!r}, but {shown(differs)} on this model is not the code CI verified it on "
                f"(transformers {column_text(here)}): changed in Python, an edited install, or a class of another "
                "module"), ""
    if plan.release is not None:
        return str(plan.release), ""
    files = plan.patchset.files
    if name is not None:
        on = ", ".join(column_text(c) for c in columns)
        return f"bundled content CI verified on transformers {on}, not on the installed {column_text(here)}", ""
    if files and is_bundled(plan.patchset):
        return f"an edited bundled patchset: {files[0]} is not the content CI verified", ""
    if files:
        return f"a patchset of your own, {files[0]}", ""
    return "a patchset of your own, built in memory (a dict or a Patchset)", ""


def verification_path(model: nn.Module, plan: Plan, policy: Policy) -> VerificationPath:
    """What applying ``plan`` to ``model`` does about verification under ``policy``; changes nothing."""
    model_type = plan.model_type
    if not plan.patched:
        return VerificationPath("nothing", model_type=model_type)
    why, detail = not_known_verified(plan, model)
    if why is None:  # the common path costs a hash of the content and a dict lookup, nothing more
        return VerificationPath("bundled", detail=detail, model_type=model_type)
    source = verify_command(plan.patchset)
    if policy == "trust":
        return VerificationPath("trust", why, source=source, model_type=model_type)
    from engine.releases.cache import VerdictStore

    key, material = key_for(model, plan)
    store = VerdictStore()
    entry = store.read(key, material)
    if entry is not None:
        verdict = ReleaseVerdict.from_entry(entry["verdict"], cache_file=str(store.path(key)), cached=True)
        return VerificationPath("cached", why, verdict=verdict, source=source, model_type=model_type)
    return VerificationPath("refuse" if policy == "refuse" else "verify", why, source=source, model_type=model_type)
