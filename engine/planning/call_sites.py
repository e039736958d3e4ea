"""Where a module's forward calls a function, and whether its own config lets it: a function patch goes only there.

Why: Falcon's attention calls ``apply_rotary_pos_emb`` only under ``if not self.config.alibi:``, so on an
ALiBi config (falcon-rw) rope is never called; the bundled rope patch was installed anyway, and
``engine.verify`` then failed "never called". A forward that names the function is a caller unless every
use of the name sits under a condition that reads, from the module itself, a value that rules it out:

* the condition is evaluated, never guessed: only attribute chains of the forward's ``self`` (its
  config included; not ``training`` or ``gradient_checkpointing``, which change after planning),
  constants, ``not``/``and``/``or``, and comparisons (``is``, ``==``, ``in``, ...) of plain values
  (``None``, booleans, numbers, strings); anything else (a local, a call, a tensor) is unknown, and
  unknown means "may call it";
* ``if``/``elif``/``else`` and ``x if c else y`` guards count; an earlier ``return`` does not (it is not
  read), so a forward can only be judged a caller too often, never too rarely: leaving a module out of a
  function patch can only patch less, never change its numbers;
* a forward whose source cannot be read (a class defined in ``python -c``) is a caller.
"""

from __future__ import annotations

import ast
import functools
import inspect
import operator
import textwrap
import types
from typing import Any

__all__ = ["calling_function", "calls_name", "never_calls"]

_MISSING = object()  # a value the evaluation cannot know
_PLAIN = (bool, int, float, str, type(None))
#: Attributes a model flips after planning (``model.train()``, ``gradient_checkpointing_enable()``): unknown.
_RUNTIME = frozenset({"training", "gradient_checkpointing"})
_COMPARE = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Gt: operator.gt, ast.GtE: operator.ge}


def calling_function(cls: type, name: str) -> types.FunctionType | None:
    """The function whose code names ``name``: ``cls.forward`` itself, or what its decorators wrap.

    Through decorators: ``__wrapped__`` where the decorator set it, else the functions its closure
    holds (transformers 5.15's ``force_accelerate_hooks`` wraps a forward without ``functools.wraps``).
    """
    pending = [getattr(cls, "forward", None)]
    seen = 0
    while pending and seen < 16:
        forward = pending.pop(0)
        seen += 1
        code = getattr(forward, "__code__", None)
        if code is not None and name in code.co_names:
            return forward  # type: ignore[return-value]
        inner = getattr(forward, "__wrapped__", None)
        if inner is not None:
            pending.append(inner)
        else:
            cells = getattr(forward, "__closure__", None) or ()
            pending += [c.cell_contents for c in cells if isinstance(_cell_value(c), types.FunctionType)]
    return None


def calls_name(cls: type, name: str) -> dict[str, Any] | None:
    """The globals ``cls.forward`` resolves ``name`` in, if its code (through decorators) names it."""
    function = calling_function(cls, name)
    return function.__globals__ if function is not None else None


def _cell_value(cell: Any) -> Any:
    """A closure cell's content; None for a cell not yet filled."""
    try:
        return cell.cell_contents
    except ValueError:
        return None


Guard = tuple  # (condition expression, the truth value the use needs)


@functools.lru_cache(maxsize=512)
def _uses(code: types.CodeType, name: str) -> tuple[str, tuple[tuple[Guard, ...], ...]] | None:
    """The forward's ``self`` parameter and, per use of ``name``, the guards it sits under; None: unreadable."""
    try:
        source = textwrap.dedent(inspect.getsource(code))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError, IndentationError):
        return None
    function = next((n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                     and n.name == code.co_name), None)
    if function is None or not function.args.args:
        return None
    found: list[tuple[Guard, ...]] = []

    def visit(node: ast.AST, guards: tuple[Guard, ...]) -> None:
        if isinstance(node, (ast.If, ast.IfExp)):
            visit(node.test, guards)
            for child in (node.body if isinstance(node.body, list) else [node.body]):
                visit(child, guards + ((node.test, True),))
            for child in (node.orelse if isinstance(node.orelse, list) else [node.orelse]):
                visit(child, guards + ((node.test, False),))
            return
        if isinstance(node, ast.Name) and node.id == name:
            found.append(guards)
        for child in ast.iter_child_nodes(node):
            visit(child, guards)

    for statement in function.body:
        visit(statement, ())
    return function.args.args[0].arg, tuple(found)


def _value(node: ast.AST, me: str, module: Any) -> Any:
    """What ``node`` evaluates to on ``module`` (``me`` is the forward's ``self``), or :data:`_MISSING`."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return module if node.id == me else _MISSING
    if isinstance(node, ast.Attribute):
        holder = _value(node.value, me, module)
        if holder is _MISSING or isinstance(holder, _PLAIN) or node.attr in _RUNTIME:
            return _MISSING
        try:
            return getattr(holder, node.attr)
        except Exception:  # an attribute the object does not have, or a property that fails: unknown
            return _MISSING
    if isinstance(node, (ast.Tuple, ast.List)):
        items = [_value(e, me, module) for e in node.elts]
        return _MISSING if any(i is _MISSING or not isinstance(i, _PLAIN) for i in items) else tuple(items)
    return _truth(node, me, module)


def _truth(node: ast.AST, me: str, module: Any) -> Any:
    """True or False where ``node`` is a condition the module's values decide, else :data:`_MISSING`."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        inner = _truth(node.operand, me, module)
        return _MISSING if inner is _MISSING else not inner
    if isinstance(node, ast.BoolOp):
        values = [_truth(v, me, module) for v in node.values]
        decisive = isinstance(node.op, ast.Or)  # True decides an `or`, False an `and`
        if decisive in values:
            return decisive
        return _MISSING if _MISSING in values else not decisive
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        left, right = _value(node.left, me, module), _value(node.comparators[0], me, module)
        op = node.ops[0]
        if left is _MISSING or right is _MISSING:
            return _MISSING
        if isinstance(op, (ast.Is, ast.IsNot)) and (left is None or right is None):
            return (left is right) == isinstance(op, ast.Is)
        if isinstance(op, (ast.In, ast.NotIn)) and isinstance(left, _PLAIN) and isinstance(right, tuple):
            return (left in right) == isinstance(op, ast.In)
        if type(op) in _COMPARE and isinstance(left, _PLAIN) and isinstance(right, _PLAIN):
            try:
                return bool(_COMPARE[type(op)](left, right))
            except TypeError:
                return _MISSING
        return _MISSING
    if isinstance(node, (ast.Constant, ast.Name, ast.Attribute)):
        value = _value(node, me, module)
        return bool(value) if isinstance(value, _PLAIN) else _MISSING
    return _MISSING


def never_calls(module: Any, name: str) -> str | None:
    """Why ``module``'s forward never calls ``name`` with its own values; None where it may (or cannot be told).

    The reason names the guard and the value that rules each use out, e.g. ``FalconAttention.forward calls it
    only under `if not self.config.alibi` (here self.config.alibi = True)``.
    """
    function = calling_function(type(module), name)
    code = getattr(function, "__code__", None)
    uses = _uses(code, name) if code is not None else None
    if not uses or not uses[1]:
        return None
    me, guards_per_use = uses
    why: list[str] = []
    for guards in guards_per_use:
        ruled_out = next((g for g in guards if _truth(g[0], me, module) is (not g[1])), None)
        if ruled_out is None:
            return None
        test, wanted = ruled_out
        text = ast.unparse(test)
        read = [(ast.unparse(n), _value(n, me, module)) for n in ast.walk(test) if isinstance(n, ast.Attribute)]
        shown = ", ".join(f"{attr} = {value!r}" for attr, value in read if isinstance(value, _PLAIN))
        why.append((f"`if {text}`" if wanted else f"the `else` of `if {text}`") + (f" (here {shown})" if shown else ""))
    cls = type(module).__name__
    return f"{cls}.{function.__name__} calls it only under " + "; ".join(dict.fromkeys(why))
