"""What a patch changed on the copy's own modules, put back and put in place again, to see what the whole model owes it.

Why: a change is judged on its own (a module on its recorded inputs, its backward on a cotangent of its own), and
some of what a change does shows only in the whole model. A hook that scales a weight's gradient after it is
accumulated (``register_post_accumulate_grad_hook``) never runs in a module's ``autograd.grad``: its row said
``same`` while the whole model's gradients differed. And an exact patch (a norm's input cloned, or flattened to
2-D and back, as fused kernels do) adds a node to autograd's graph: where a tensor feeds the norm and the residual,
autograd sums their gradients in another order, the gradients are not bit-identical (within the original's own
rounding error), and the report said "a change the detector cannot see", which was false: the change was found.

Both are settled the same way, by the whole model's own numbers: the change is put back on the patched copy, the
copy runs again, and the patch's own objects are put in place after (:func:`undoers_of`). Two uses:
:func:`locate_instance_changes` (a row whose change, put back, makes the failed checks pass, differs: never
``same``) and :func:`found_changes_account` (every change found put back at once: is the whole model then
bit-identical? then they account for it, and nothing unseen does).
"""

from __future__ import annotations

import contextlib
import copy
import types
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

from engine.auditing.put_back import MOST_TRIED, Undoers
from engine.auditing.report import check_key, checks_text
from engine.verification.results import Check

__all__ = ["found_changes_account", "locate_instance_changes", "undoers_of"]

#: Kinds of change a module's own check can miss (hooks run by the whole model's backward, numbers a forward
#: reads): tried whenever a whole-model check fails. Others are tried only where no row explains the failure.
_MISSABLE = ("hooks added", "gradient hooks added", "attributes changed")


def _tables(obj: Any, names: tuple[str, ...]) -> tuple[Callable[[], None], Callable[[], None]]:
    """Hook tables of a module or tensor: undo keeps only the hooks ``names``' twins on the original hold."""
    saved = {name: dict(getattr(obj, name) or {}) for name in names}

    def undo(keep: dict[str, set[int]]) -> None:
        for name in names:
            table = getattr(obj, name)
            for key, hook in list((table or {}).items()):
                if id(getattr(hook, "__func__", hook)) not in keep[name]:
                    del table[key]

    def redo() -> None:
        for name in names:
            table = getattr(obj, name)
            if table is not None:
                table.clear()
                table.update(saved[name])

    return undo, redo  # type: ignore[return-value]


_MODULE_HOOKS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
_TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")


def _held(obj: Any, names: tuple[str, ...]) -> dict[str, set[int]]:
    return {n: {id(getattr(h, "__func__", h)) for h in (getattr(obj, n, None) or {}).values()} for n in names}


def _undo(kind: str, original: nn.Module, patched: nn.Module, parent: Any, name: str) -> tuple[Any, Any] | None:
    """Undo and redo of one change of ``patched`` (the copy's module at the row's path), or None where it cannot be."""
    if kind == "forward replaced":
        own = original.__dict__.get("forward")
        theirs = types.MethodType(own.__func__, patched) if hasattr(own, "__func__") else own
        mine = patched.__dict__.get("forward")

        def put(value: Any) -> None:
            if value is None:
                patched.__dict__.pop("forward", None)
            else:
                patched.__dict__["forward"] = value
        return (lambda: put(theirs), lambda: put(mine))
    if kind == "class swapped":
        want, mine_cls = type(original), type(patched)
        return (lambda: setattr(patched, "__class__", want), lambda: setattr(patched, "__class__", mine_cls))
    if kind == "hooks added":
        undo, redo = _tables(patched, _MODULE_HOOKS)
        keep = _held(original, _MODULE_HOOKS)
        return (lambda: undo(keep), redo)
    if kind == "gradient hooks added":
        pairs = [(p, dict(original.named_parameters(recurse=False)).get(n))
                 for n, p in patched.named_parameters(recurse=False)]
        parts = [(_tables(p, _TENSOR_HOOKS), _held(o, _TENSOR_HOOKS)) for p, o in pairs if o is not None]
        return (lambda: [u(k) for (u, _), k in parts], lambda: [r() for (_, r), _ in parts])
    if kind == "attributes changed":
        theirs, mine = dict(vars(original)), dict(vars(patched))
        keys = [k for k in theirs.keys() | mine.keys() if not k.startswith("_") and k != "training"
                and not isinstance(theirs.get(k, mine.get(k)), (nn.Module, nn.Parameter))]

        def put_attrs(values: dict[str, Any]) -> None:
            for k in keys:
                if k in values:
                    patched.__dict__[k] = values[k]
                else:
                    patched.__dict__.pop(k, None)
        return (lambda: put_attrs(theirs), lambda: put_attrs(mine))
    if kind == "weights changed":
        pairs = []
        for n, t in [*patched.named_parameters(recurse=False), *patched.named_buffers(recurse=False)]:
            o = dict([*original.named_parameters(recurse=False), *original.named_buffers(recurse=False)]).get(n)
            if o is None or o.shape != t.shape or o.dtype != t.dtype:
                return None
            pairs.append((t, o.detach().to(t.device).clone(), t.data))
        return (lambda: [setattr(t, "data", o) for t, o, _ in pairs],
                lambda: [setattr(t, "data", d) for t, _, d in pairs])
    if kind == "submodule replaced" and parent is not None:
        fresh = copy.deepcopy(original)
        return (lambda: parent._modules.__setitem__(name, fresh), lambda: parent._modules.__setitem__(name, patched))
    return None


def undoers_of(rows: list[Any], original: nn.Module, patched: nn.Module) -> dict[int, tuple[Any, Any]]:
    """Undo and redo of each row's change on the copy's modules, by ``id(row)`` (rows it cannot put back: none)."""
    named, mine = dict(original.named_modules()), dict(patched.named_modules())
    out: dict[int, tuple[Any, Any]] = {}
    for row in rows:
        if row.path not in named or row.path not in mine or row.cls in ("-", "function", "config"):
            continue
        parent_path, _, name = row.path.rpartition(".")
        found = _undo(row.change, named[row.path], mine[row.path], mine.get(parent_path), name)
        if found is not None:
            out[id(row)] = found
    return out


@contextlib.contextmanager
def _all_undone(undos: list[tuple[Callable[[], Any], Callable[[], Any]]]) -> Iterator[None]:
    done: list[Callable[[], Any]] = []
    try:
        for undo, redo in undos:
            undo()
            done.append(redo)
        yield
    finally:
        for redo in reversed(done):
            redo()


def locate_instance_changes(rows: list[Any], checks: list[Check], undo: dict[int, tuple[Any, Any]],
                            rerun: Callable[[], list[Check]], ratios: dict[str, float]) -> None:
    """Put back each group of rows said ``same`` or ``passes`` (one class, one kind of change, one object put
    there) and run again. Where a whole-model check failed, a group without which the failed checks pass differs.
    A hook or attribute row said ``same`` whose putting back moves the whole model's numbers (within the rounding
    error) passes, and says so: it is never ``same`` while the whole model runs it to other numbers."""
    failed = [c.what for c in checks if not c.passed]
    moved = any(c.max_abs != 0 for c in checks)
    if not failed and not moved:
        return
    explained = any(r.result == "differs" for r in rows)
    groups: dict[tuple[str, str, str], list[Any]] = {}
    for row in rows:
        if id(row) not in undo or row.result not in ("same", "passes"):
            continue
        if (row.change in _MISSABLE and row.result == "same") or (failed and not explained):
            groups.setdefault((row.cls, row.change, row.detail), []).append(row)
    worst = max((ratios.get(check_key(what), 0.0) for what in failed), default=0.0)
    ordered = sorted(groups.values(), key=lambda g: g[0].change not in _MISSABLE)
    for group in ordered[:MOST_TRIED]:
        with _all_undone([undo[id(r)] for r in group]):
            again = rerun()
        if failed and not any(not c.passed for c in again if c.what in failed):
            under_conditions = all(w.endswith("]") for w in failed)
            why = ("on the probe's recorded inputs, which the condition's are not" if under_conditions else
                   "(it runs only where the whole model runs it: a hook on an accumulated gradient, a number read "
                   "elsewhere)")
            for row in group:
                was = row.result
                row.result, row.ratio, row.evidence = "differs", worst or None, "put back"
                row.note = (f"its own check was {was} {why}; with it put back, the whole model's {checks_text(failed)} "
                            "pass: this change is what moves them")
            continue
        shifted = [c.what for c, a in zip(checks, again, strict=False)
                   if (c.max_abs, c.max_rel, c.note) != (a.max_abs, a.max_rel, a.note)]  # other numbers, for certain
        if not failed and shifted:
            for row in [r for r in group if r.result == "same"]:
                row.result, row.evidence = "passes", "put back"
                row.note = (f"its own check was same, and the whole model runs it to other numbers: with it put back "
                            f"its {checks_text(shifted)} change (within the original's rounding error)")


def found_changes_account(rows: list[Any], undo: dict[int, tuple[Any, Any]], process: Undoers,
                          rerun: Callable[[], list[Check]]) -> bool | None:
    """Every change found put back at once: is the whole model then bit-identical to the original's?

    None where some change found cannot be put back (nothing is shown then), or nothing was found."""
    found = [r for r in rows if r.result != "not in this model"]
    if not found:
        return None
    undos: list[tuple[Callable[[], Any], Callable[[], Any]]] = []
    for row in found:
        if id(row) in undo:
            undos.append(undo[id(row)])
        elif row.path in process:
            undos.append(process[row.path])
        elif row.change != "class attribute replaced (process-wide)":  # put back with the process's changes below
            return None
    undos += [u for path, u in process.items() if path not in {r.path for r in found}]
    with _all_undone(undos):
        again = rerun()
    return all(c.passed and c.max_abs == 0 for c in again)
