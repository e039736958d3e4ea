"""Drift: has the installed library changed the forward a patch was written against?

A patch may pin its target's signature as ``inspect.signature`` prints it::

    signature: "(self, hidden_states: torch.Tensor) -> torch.Tensor"

The planner compares the pin with the installed forward (or function) structurally, not as
text: both are parsed as a Python parameter list, so spacing and quoted annotations do not
matter, while a renamed, added, removed or reordered parameter, a changed default, kind or
annotation does, and the error says which.

Why a signature and not a hash of the source: a source hash changes on every comment or
docstring edit and cannot say *what* changed; a change of the body's numbers is what
:func:`engine.verify` is for.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.foundation.see_through import see_through

__all__ = ["Param", "parse_signature", "signature_changes", "signature_text"]


@dataclass(frozen=True)
class Param:
    """One parameter of a signature, as comparable text."""

    name: str
    kind: str  # positional-only, positional, *args, keyword-only, **kwargs
    annotation: str | None
    default: str | None


def _text(node: ast.expr | None) -> str | None:
    """Normalized source of an annotation or default; a quoted annotation reads as its content."""
    if node is None:
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        try:
            return ast.unparse(ast.parse(node.value, mode="eval").body)
        except SyntaxError:
            return repr(node.value)
    return ast.unparse(node)


def parse_signature(text: str) -> tuple[list[Param], str | None]:
    """``(parameters, return annotation)`` of a signature such as ``(self, x: int = 1) -> int``.

    Raises:
        ValueError: when ``text`` is not a parenthesized Python parameter list.
    """
    source = text.strip()
    if not source.startswith("("):
        raise ValueError(f"{text!r} is not a signature such as '(self, hidden_states: torch.Tensor) -> torch.Tensor'")
    try:
        tree = ast.parse(f"def _f{source}:\n    pass\n")
    except SyntaxError as exc:
        raise ValueError(
            f"{text!r} is not a signature such as '(self, hidden_states: torch.Tensor) -> torch.Tensor' ({exc.msg})"
        ) from None
    if len(tree.body) != 1 or not isinstance(tree.body[0], ast.FunctionDef):
        raise ValueError(f"{text!r} is not a single signature")
    fn = tree.body[0]
    args = fn.args
    positional = [(a, "positional-only") for a in args.posonlyargs] + [(a, "positional") for a in args.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    params = [Param(a.arg, kind, _text(a.annotation), _text(d)) for (a, kind), d in zip(positional, defaults)]
    if args.vararg is not None:
        params.append(Param(args.vararg.arg, "*args", _text(args.vararg.annotation), None))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        params.append(Param(a.arg, "keyword-only", _text(a.annotation), _text(d)))
    if args.kwarg is not None:
        params.append(Param(args.kwarg.arg, "**kwargs", _text(args.kwarg.annotation), None))
    return params, _text(fn.returns)


def signature_text(function: Callable[..., Any]) -> str:
    """The signature of ``function`` (seen through decorators, our router and ``kernels`` ``Func``
    modules, whose own signature is ``(*args, **kwargs)``) as ``inspect`` prints it."""
    return str(inspect.signature(see_through(function)))


def signature_changes(expected: str, found: str) -> list[str]:
    """What differs between two signatures, in words; empty when they are the same."""
    (want, want_ret), (got, got_ret) = parse_signature(expected), parse_signature(found)
    changes: list[str] = []
    want_by, got_by = {p.name: p for p in want}, {p.name: p for p in got}
    removed = [p.name for p in want if p.name not in got_by]
    added = [p.name for p in got if p.name not in want_by]
    pairs: list[tuple[Param, Param]] = []
    if len(removed) == len(added) == 1 and [p.name for p in want].index(removed[0]) == [
        p.name for p in got
    ].index(added[0]):
        changes.append(f"parameter {removed[0]!r} renamed to {added[0]!r}")
        pairs.append((want_by[removed[0]], got_by[added[0]]))
    else:
        changes += [f"parameter {n!r} removed" for n in removed]
        changes += [f"parameter {n!r} added" for n in added]
    common_want = [p.name for p in want if p.name in got_by]
    common_got = [p.name for p in got if p.name in want_by]
    if common_want != common_got:
        changes.append(f"parameters reordered: ({', '.join(common_want)}) -> ({', '.join(common_got)})")
    pairs = [(want_by[n], got_by[n]) for n in common_want] + pairs
    for a, b in pairs:
        name = b.name
        if a.kind != b.kind:
            changes.append(f"{name!r} became {b.kind} (was {a.kind})")
        if a.annotation != b.annotation:
            changes.append(f"annotation of {name!r}: {a.annotation or 'none'} -> {b.annotation or 'none'}")
        if a.default != b.default:
            changes.append(f"default of {name!r}: {a.default or 'none'} -> {b.default or 'none'}")
    if want_ret != got_ret:
        changes.append(f"return annotation: {want_ret or 'none'} -> {got_ret or 'none'}")
    return changes
