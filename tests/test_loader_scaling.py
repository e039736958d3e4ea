"""Loading is linear in the number of patches (issue 11, scenario 6), checked without timing.

A 5,000-patch patchset once took 88 s: the ``extends`` merge moved each patch's line origins
by scanning the whole origin table, and the error rewriter scanned every error for each union
error. Instead of a clock, the test counts the Python lines the loader package executes
(``sys.settrace``, restricted to ``engine/loader/``) for n and 4n patches: linear work grows
about 4x, a quadratic walk 16x. ``benchmarks/loader_scaling.py`` prints the times.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import engine.loader
from engine.errors import PatchsetError
from engine.loader import load_patchset

LOADER_DIR = str(Path(engine.loader.__file__).resolve().parent)

SMALL, FACTOR = 150, 4

#: Work for FACTOR times the patches may grow by at most this factor (linear: about FACTOR;
#: quadratic: FACTOR**2). The slack covers fixed costs and sorting (n log n).
MAX_GROWTH = FACTOR * 1.4


def _patches(n: int, *, every: int = 1, scale: str = "weight", kernel: str | None = None) -> str:
    lines = []
    for i in range(0, n * every, every):
        lines += [f"  - target: Norm{i:06d}", "    op: rms_norm", f"    scale: {scale}"]
        if kernel is not None:
            lines.append(f"    kernel: {kernel}")
    return "\n".join(lines) + "\n"


def _write(folder: Path, shape: str, n: int) -> Path:
    head = "name: big\nmodel_types: [qwen3]\npatches:\n"
    path = folder / f"{shape}_{n}.yaml"
    if shape == "plain":
        path.write_text(head + _patches(n), encoding="utf-8")
    elif shape == "extends":  # a child replacing every other base patch, adding as many
        (folder / f"base_{n}.yaml").write_text(head + _patches(n), encoding="utf-8")
        child = f"name: child\nextends: base_{n}.yaml\npatches:\n" + _patches(n, every=2, scale="one_plus_weight")
        path.write_text(child, encoding="utf-8")
    elif shape == "errors":  # every patch has an error, in a union-typed key
        path.write_text(head + _patches(n, kernel="[1]"), encoding="utf-8")
    return path


def _loader_lines(path: Path) -> tuple[int, int]:
    """(Python lines executed inside engine/loader/ while loading ``path``, patches or errors got)."""
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(LOADER_DIR) else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        try:
            size = len(load_patchset(path).patches)
        except PatchsetError as exc:
            size = exc.count  # every problem found (only the first MAX_PROBLEMS are listed in exc.errors)
    finally:
        sys.settrace(previous)
    return count, size


@pytest.mark.parametrize("shape", ["plain", "extends", "errors"])
def test_loading_work_grows_linearly(tmp_path, shape):
    small_work, small_size = _loader_lines(_write(tmp_path, shape, SMALL))
    large_work, large_size = _loader_lines(_write(tmp_path, shape, SMALL * FACTOR))
    assert large_size == small_size * FACTOR  # the files hold what they should
    assert small_work > 0
    growth = large_work / small_work
    assert growth < MAX_GROWTH, (
        f"{shape}: {FACTOR}x the patches cost {growth:.1f}x the loader's work "
        f"({small_work} -> {large_work} lines): a walk in engine/loader/ is not linear"
    )


def test_ten_thousand_patches_are_not_refused_by_the_size_limits(tmp_path):
    """The node and byte limits (against alias bombs, huge files) admit 10,000 real patches."""
    path = tmp_path / "big.yaml"
    text = "name: big\nmodel_types: [qwen3]\npatches:\n" + _patches(10_000, kernel="torch").replace(
        "scale: weight\n", "scale: weight\n    eps_attr: variance_epsilon\n    cast: llama\n"
    )
    path.write_text(text, encoding="utf-8")
    patchset = load_patchset(path)
    assert len(patchset.patches) == 10_000 and patchset.patches[-1].target == "Norm009999"
