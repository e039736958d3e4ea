"""The code a plan patches, by identity, and whether CI verified bundled content on exactly that code.

Why: bundled content used to be vouched for by its content hash and the release's version, so a
class rebound in Python, a same-named class of the user's, or an edited transformers install
under the same version was patched as "verified". A verdict now names the code it ran
(:func:`engine.foundation.code_identity.code_identity`): the matrix records, per release, the
identity of every class and function each bundled patchset patched in its verification (the
manifest's ``code``), and :func:`unverified_code` compares the live code the user's plan patches
with it. Any difference is code nobody verified: the gate verifies it where it runs, like a
release CI did not run.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any

from torch import nn

from engine.foundation.code_identity import code_identity, own_class

__all__ = ["code_key", "code_not_verified", "patched_code", "shown", "unverified_code"]


def code_key(decision: Any, module: nn.Module | None) -> tuple[str, Any]:
    """``("class Qwen3RMSNorm", the class)`` or ``("function apply_rotary_pos_emb", the function)`` of a decision."""
    if decision.site is not None:
        namespace = sys.modules.get(decision.site.namespace)
        return f"function {decision.site.function}", getattr(namespace, decision.site.function, None)
    cls = own_class(type(module)) if module is not None else None  # FSDP2's FSDP<Name>: the class it wraps
    return f"class {cls.__qualname__ if cls is not None else decision.cls}", cls


def patched_code(model: nn.Module, decisions: Iterable[Any]) -> dict[str, str]:
    """``{"class Qwen3RMSNorm": identity, ...}`` for every class and function ``decisions`` patch on ``model``.

    Two classes of one name at once (a user's ``Qwen3RMSNorm`` in some layers, transformers' in
    others) give both identities, joined, so neither can pass for the other.
    """
    modules = dict(model.named_modules())
    found: dict[str, set[str]] = {}
    identities: dict[int, str] = {}  # one walk per class or function, however many modules it has
    for d in decisions:
        if getattr(d, "action", "patch") != "patch":
            continue
        key, obj = code_key(d, modules.get(d.path))
        if id(obj) not in identities:
            identities[id(obj)] = code_identity(obj) if obj is not None else "missing"
        found.setdefault(key, set()).add(identities[id(obj)])
    return {key: "+".join(sorted(ids)) for key, ids in sorted(found.items())}


def unverified_code(live: Mapping[str, str], recorded: Mapping[str, str] | None) -> list[str]:
    """The keys of ``live`` whose identity is not the one CI recorded (all of them where nothing was recorded)."""
    if recorded is None:
        return sorted(live)
    return sorted(key for key, identity in live.items() if recorded.get(key) != identity)


def code_not_verified(model: nn.Module, plan: Any) -> list[str] | None:
    """What ``plan`` patches on ``model`` whose live code is not the code CI verified its content on, here.

    ``None`` where CI did not verify this content on the installed release at all (the release
    gate's business); ``[]`` where every class and function runs the code CI ran. The fused head
    is left out: it is a switch of the engine, not content, and its plan reads the live forward's
    code itself (:mod:`engine.planning.fused_head` refuses a forward it does not know).
    """
    from engine.planning.fused_head import OP as FUSED_HEAD
    from engine.releases.manifest import content_sha256, installed_column, verified_code, verified_columns

    sha = content_sha256(plan.patchset)
    here = installed_column()
    if here not in verified_columns(sha)[1]:
        return None
    family = [d for d in plan.patched if d.op != FUSED_HEAD]
    return unverified_code(patched_code(model, family), verified_code(sha, here))


def shown(keys: list[str], limit: int = 4) -> str:
    """``Qwen3RMSNorm, apply_rotary_pos_emb and 3 more``: code keys by their names, for a message."""
    names = ", ".join(key.split(" ", 1)[-1] for key in keys[:limit])
    return names + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
