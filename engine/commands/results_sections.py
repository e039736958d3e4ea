"""Sections of a results file (``benchmarks/results/cpu.md``) that several benchmark scripts share.

Why: each benchmark writes its own part of one file (``engine.commands.bench`` the op / overhead /
training tables, ``benchmarks/flce.py`` the fused-head tables, ``benchmarks/moe.py`` the MoE
table), at different times and on different machines. A marked section
(``<!-- name:begin -->`` ... ``<!-- name:end -->``) belongs to one script; rewriting the file
from one script must leave the others' sections as they are.
"""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["marked_sections", "write_section", "write_unmarked"]

_SECTION = re.compile(r"<!-- ([\w.\-]+):begin -->\n.*?<!-- \1:end -->\n?", re.DOTALL)


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def write_section(path: Path, text: str, name: str) -> None:
    """Put ``text`` in ``path`` between section ``name``'s markers, leaving everything else as it is.

    The section replaces its previous version in place, or is appended if the file has none.
    """
    begin, end = _markers(name)
    block = f"{begin}\n{text.rstrip()}\n{end}\n"
    current = path.read_text() if path.exists() else ""
    if begin in current and end in current:
        head, rest = current.split(begin, 1)
        current = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        current = current.rstrip("\n") + ("\n\n" if current else "") + block
    path.write_text(current)


def marked_sections(text: str) -> list[str]:
    """Every marked section of ``text``, markers included, in order."""
    return [m.group(0).rstrip("\n") + "\n" for m in _SECTION.finditer(text)]


def write_unmarked(path: Path, text: str) -> None:
    """Write ``text`` as the unmarked part of ``path`` (first), keeping every marked section after it."""
    kept = marked_sections(path.read_text()) if path.exists() else []
    parts = [text.rstrip("\n") + "\n", *kept]
    path.write_text("\n".join(parts))
