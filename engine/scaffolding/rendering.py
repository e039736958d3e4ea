"""The scaffold's result (:class:`Scaffold`), written as a patchset YAML a person can read and check.

Every patch carries a comment saying what was measured (``fp32 exact, bf16 exact``) and how
far off the other declarations were, so a reader sees *why* ``scale: weight`` and not
``one_plus_weight``. Whatever is not patched is listed as a comment with the reason: no op
computes it, the closest declaration missed by so much, two declarations tie, or an opt-in
op fits but changes the model's contract.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from engine.ops.base import get_op
from engine.scaffolding.findings import Finding, Measurement

__all__ = ["Scaffold", "render", "settings_text"]

#: Patch keys that say what to patch or how to run it, not what the target computes.
_NOT_SETTINGS = {"kernel", "optional", "signature", "target", "function", "op"}
#: How many of the other (inexact) declarations a patch comment names.
_SHOWN_ALTERNATIVES = 3


def settings_text(patch: Any, keys: list[str] | None = None) -> str:
    data = patch.model_dump(mode="json", exclude=_NOT_SETTINGS)
    keys = [k for k in (keys if keys is not None else list(data)) if k in data]
    return ", ".join(f"{k}: {data[k]}" for k in keys) or "defaults"


def _num(x: float) -> str:
    return "inf" if x == float("inf") else f"{x:.1e}"


def _worst(m: Measurement) -> float:
    return max(m.errors.values(), default=float("inf")) if m.problem is None else float("inf")


def _off_by(m: Measurement) -> str:
    if m.problem is not None:
        return f"fails ({m.problem[:120]})"
    worst = _worst(m)
    only = " (bf16 only: fp32 cannot tell them apart)" if m.errors.get("fp32") == 0.0 else ""
    return f"off by {_num(worst)}{only}"


def _differs(m: Measurement, chosen: Measurement) -> list[str]:
    mine = m.patch.model_dump(mode="json", exclude=_NOT_SETTINGS)
    theirs = chosen.patch.model_dump(mode="json", exclude=_NOT_SETTINGS)
    keys = [k for k in mine if mine[k] != theirs.get(k)]
    return keys if m.patch.op == chosen.patch.op else list(mine)


def _where(f: Finding) -> str:
    # code outside transformers (remote code, a user's module, torch.nn) says where it lives
    origin = f", from {f.origin}" if f.origin and not f.origin.startswith("transformers.") else ""
    if f.kind == "module":
        return f"{f.name} ({f.instances} module{'s' if f.instances != 1 else ''}{origin})"
    return f"{f.name} (called from {f.instances} modeling module{'s' if f.instances != 1 else ''}{origin})"


def _patch_comment(f: Finding, chosen: Measurement) -> str:
    head = f"# {_where(f)}: " + ", ".join(f"{dt} exact" for dt in chosen.errors)
    others = sorted((m for m in f.measurements if m is not chosen), key=_worst)
    if not others:
        return head + "; the only declaration the ops admit"
    parts = []
    for m in others[:_SHOWN_ALTERNATIVES]:
        label = settings_text(m.patch, _differs(m, chosen))
        prefix = f"{m.patch.op} " if m.patch.op != chosen.patch.op else ""
        parts.append(f"{prefix}{label} {_off_by(m)}")
    more = len(others) - _SHOWN_ALTERNATIVES
    tail = f"; and {more} more" if more > 0 else ""
    return head + "\n#   other declarations: " + "\n#     ".join(parts) + tail


def _patch_lines(patch: Any) -> list[str]:
    """The patch as YAML lines: what it replaces, the op, then every setting a reader must see
    (the op's ``declared_settings``, required ones, and any that differ from the default)."""
    op = get_op(patch.op)
    data = patch.model_dump(mode="json")
    first = "target" if "target" in data else "function"
    lines = [f"  - {first}: {data[first]}", f"    op: {patch.op}"]
    for key, value in data.items():
        if key in _NOT_SETTINGS:
            continue
        field = type(patch).model_fields[key]
        if key in op.declared_settings or field.is_required() or value != _json(field.default):
            lines.append(f"    {key}: {_scalar(value)}")
    return lines


def _json(value: Any) -> Any:
    return getattr(value, "value", value)


def _scalar(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def _not_patched(f: Finding) -> str | None:
    """One comment line for a finding that yields no patch (``None`` for a chosen one)."""
    if f.chosen is not None:
        return None
    exact = f.exact
    if len(exact) > 1:
        labels = " | ".join(f"{m.patch.op} {settings_text(m.patch)}" for m in exact)
        return (f"# tie, not patched: {_where(f)}: {len(exact)} declarations are exact: {labels}; "
                "picks neither (measure on a model that tells them apart)")
    if f.opt_in:
        return (f"# opt-in, not added: {f.name} fits {', '.join(f.opt_in)} (in training it returns no logits); "
                f"add `- {{target: {f.name}, op: {f.opt_in[0]}}}` to use it")
    if f.note:
        return f"# not patched: {_where(f)}: {f.note}"
    measured = [m for m in f.measurements if m.errors]
    if measured:
        best = min(measured, key=_worst)
        return f"# not patched: {_where(f)}: closest is {best.patch.op} {settings_text(best.patch)}, {_off_by(best)}"
    if f.refused:
        return "# not patched: " + f"{_where(f)}: " + "; ".join(f"{op}: {why}" for op, why in f.refused)
    return f"# not patched: {_where(f)}: no op computes it"


def _name(model_type: str) -> str:
    """The patchset name: the model type, with characters the schema's name pattern refuses replaced."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", model_type) or "scaffolded"


def _foreign_lines(result: Scaffold) -> list[str]:
    """Header lines for a model whose code is not all transformers': where it is, and how to verify it."""
    if result.tiny_config is not None:
        return []
    where = sorted(set(result.foreign.values()))
    return [
        f"# {result.model_type}'s code is not all in transformers ({', '.join(where) or 'see the classes below'}),",
        "# so there is no tiny_model block and `patch-engine verify` cannot build it: verify on the model",
        "# itself: engine.apply(model, THIS_FILE, verify=True) (engine.verify(model) after apply).",
    ]


@dataclass
class Scaffold:
    """What the scaffold found for one model: a patchset's worth of findings."""

    model_type: str
    model_class: str
    #: The ``tiny_model.config`` that rebuilds the measured model from its ``model_type``;
    #: ``None`` when transformers cannot build it from the type (its code is not transformers').
    tiny_config: dict[str, Any] | None
    findings: list[Finding]
    #: The command (or call) that produced it, for the file's header.
    source: str = ""
    #: Where the classes and functions not from transformers came from (``{name: module}``).
    foreign: dict[str, str] = field(default_factory=dict)
    #: The tiny model's own type where another stands in for ``model_type`` (a composite's language
    #: model: ``gemma3n_text`` for ``gemma3n``), else ``None``.
    tiny_type: str | None = None
    #: Why that model stands in (written into the header).
    note: str = ""
    #: Model types the measured model's config reports besides those (written into ``model_types``).
    also_types: list[str] = field(default_factory=list)

    @property
    def patches(self) -> list[Any]:
        return [f.chosen.patch for f in self.findings if f.chosen is not None]

    def to_yaml(self) -> str:
        return render(self)

    def __str__(self) -> str:
        return self.to_yaml()


def render(result: Scaffold) -> str:
    """The patchset text: header, tiny model, measured patches with comments, then what is not patched."""
    import transformers

    # measured on this release only: the range claims it alone (docs/versions.md says how to widen it)
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    source = result.source or f"patch-engine scaffold {result.model_type}"
    lines = [
        f"# Generated by `{source}` (transformers {transformers.__version__}):",
        "# every declaration below is bit-exact against the original forward on a tiny perturbed",
        "# model, in fp32 and bf16. Read it before bundling it.",
        *_foreign_lines(result),
        *([f"# {result.model_type}: {result.note}."] if result.note else []),
        "# yaml-language-server: $schema=../schemas/patchset.schema.json",
        f"name: {_name(result.model_type)}",
        f"description: Scaffolded from a tiny {result.model_class}; see the comments for what was measured.",
        f"model_types: [{', '.join(_scalar(t) for t in dict.fromkeys([result.model_type, result.tiny_type or result.model_type, *result.also_types]))}]",
        f'requires: {{transformers: ">={major}.{minor},<{major}.{minor + 1}"}}',
        "on_unsupported: error",
    ]
    if result.tiny_config is not None:
        tiny = _scalar(result.tiny_config) if result.tiny_config else "{}"
        lines += ["tiny_model:", *([f"  model_type: {_scalar(result.tiny_type)}"] if result.tiny_type else []),
                  f"  config: {tiny}"]
    chosen = [f for f in result.findings if f.chosen is not None]
    lines.append("patches:" if chosen else "patches: []")
    for f in chosen:
        assert f.chosen is not None
        lines.append("  " + _patch_comment(f, f.chosen).replace("\n", "\n  "))
        lines.extend(_patch_lines(f.chosen.patch))
    rest = [line for f in result.findings if (line := _not_patched(f)) is not None]
    if rest:
        lines.append("")
        lines.extend(rest)
    return "\n".join(lines) + "\n"
