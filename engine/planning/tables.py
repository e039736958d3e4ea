"""Plain-text tables that fit a terminal: the plan's, a verification's, an audit's (``format_table``).

Why: a table wider than the terminal wraps each row at random, and the columns a reader scans
(module, result) stop lining up. Given a ``width`` (the commands print at :data:`TABLE_WIDTH`), a
table keeps its columns and gives way in this order:

1. its last column (the prose: the plan's ``why``, a check's note) wraps beneath itself, where at
   least :data:`MIN_LAST` characters are left for it;
2. else that prose goes on its own lines beneath the row, named by its header
   (``    note: ...``), so the other columns keep the width;
3. if those are still too wide, the widest of them wraps within its column (at spaces, dots,
   underscores and slashes: a module path breaks between its parts), one row over two lines
   rather than the whole table over two screens.

Without a width (and outside :func:`table_width`), a table keeps one line per row, as the Python
API always printed it.
"""

from __future__ import annotations

import contextlib
import re
import textwrap
from collections.abc import Iterable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

__all__ = ["MIN_LAST", "TABLE_WIDTH", "format_table", "table_width"]

#: The widest a command prints a table (a terminal of 120 columns; the plan's, verify's, audit's).
TABLE_WIDTH = 120
#: The narrowest the last column wraps beneath itself; narrower, it goes beneath the row.
MIN_LAST = 30
#: The narrowest any other column wraps to.
MIN_COLUMN = 8
#: How far the prose beneath a row is indented.
INDENT = 4

_WIDTH: ContextVar[int | None] = ContextVar("patch_engine_table_width", default=None)


@contextlib.contextmanager
def table_width(width: int | None = TABLE_WIDTH) -> Iterator[None]:
    """Every table formatted inside (without a ``width`` of its own) fits ``width`` (a command's output)."""
    token = _WIDTH.set(width)
    try:
        yield
    finally:
        _WIDTH.reset(token)


def _pieces(text: str, width: int) -> list[str]:
    """``text`` in lines of at most ``width``, broken after spaces, dots, underscores and slashes where it can."""
    tokens = re.findall(r"[^ ._/]*(?:[ ._/]|$)", text)
    lines, line = [], ""
    for token in (t for t in tokens if t):
        while len(token) > width:  # one part longer than the column: cut
            if line:
                lines.append(line)
                line = ""
            lines.append(token[:width])
            token = token[width:]
        if len((line + token).rstrip()) > width:
            lines.append(line)
            line = token
        else:
            line += token
    lines.append(line)
    return [piece.rstrip() for piece in lines if piece.strip()] or [""]


def _shrink(widths: list[int], cells: list[list[str]], room: int) -> list[int]:
    """The columns' widths within ``room``: each narrowing goes to the column where it wraps the fewest cells (and
    cuts no word it need not), the widest first among equals; none under :data:`MIN_COLUMN`."""
    widths = list(widths)

    def cost(i: int) -> tuple[int, int, int]:
        w = widths[i] - 1
        wrapped = [row[i] for row in cells if len(row[i]) > w]
        cut = sum(1 for c in wrapped if any(len(piece) > w for piece in re.findall(r"[^ ._/]+[ ._/]?", c)))
        return (cut, len(wrapped), -widths[i])

    while sum(widths) > room:
        narrowable = [i for i, w in enumerate(widths) if w > MIN_COLUMN]
        if not narrowable:
            break
        widths[min(narrowable, key=cost)] -= 1
    return widths


def format_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, width: int | None = None) -> str:
    """An aligned plain-text table; with ``width`` (or inside :func:`table_width`), at most that wide (module docstring)."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    width = width if width is not None else _WIDTH.get()
    start = sum(widths[:-1]) + 2 * (len(widths) - 1)
    if width is None or start + widths[-1] <= width or width - start >= MIN_LAST:
        if width is not None:
            widths[-1] = min(widths[-1], max(width - start, MIN_LAST))
        return _lines(cells, widths, start)
    # the prose beneath each row; the other columns within the width, the widest wrapping first
    head, *body = cells
    firsts = [r[:-1] for r in cells]
    kept = _shrink(widths[:-1], firsts, width - 2 * (len(widths) - 2))
    lines = _row_lines(head[:-1], kept)
    lines.append("  ".join("-" * w for w in kept))
    for row in body:
        lines += _row_lines(row[:-1], kept)
        if row[-1]:
            prose = textwrap.wrap(f"{head[-1].strip()}: {row[-1]}", width - INDENT, break_on_hyphens=False)
            lines += [" " * INDENT + piece for piece in prose]
    return "\n".join(lines)


def _row_lines(row: Sequence[str], widths: Sequence[int]) -> list[str]:
    """One row over as many lines as its tallest wrapped cell."""
    parts = [_pieces(c, w) if len(c) > w else [c] for c, w in zip(row, widths, strict=True)]
    height = max(len(p) for p in parts)
    return ["  ".join((p[k] if k < len(p) else "").ljust(w) for p, w in zip(parts, widths, strict=True)).rstrip()
            for k in range(height)]


def _lines(cells: list[list[str]], widths: list[int], start: int) -> str:
    """Every column on one line; the last wrapped beneath itself where it is wider than its width."""
    lines = []
    for r in cells:
        parts = (textwrap.wrap(r[-1], widths[-1], break_on_hyphens=False) or [""]) if len(r[-1]) > widths[-1] else [r[-1]]
        lines.append("  ".join(c.ljust(w) for c, w in zip([*r[:-1], parts[0]], widths, strict=True)).rstrip())
        lines += [(" " * start + part).rstrip() for part in parts[1:]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
