"""The benchmark script runs and writes its JSON and chart (a smoke run; no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from engine.cli import main


def test_bench_cli_writes_results(tmp_path: Path) -> None:
    assert main(["bench", "--only", "overhead,plan", "--repeats", "1", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "cpu.json").read_text())
    assert results["plan"]["modules_patched"] == 64 * 4 + 1 + 64 + 1  # 4 norms/layer, final norm, MLPs, rope
    assert results["overhead"]["direct_us"] > 0
    assert (tmp_path / "cpu.png").stat().st_size > 0


def test_bench_keeps_the_sections_other_benchmarks_wrote(tmp_path: Path) -> None:
    """``cpu.md`` holds the FLCE and MoE scripts' marked sections: rewriting the bench's tables keeps them."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import flce
        import moe
    finally:
        sys.path.pop(0)
    md = tmp_path / "cpu.md"
    md.write_text("old bench tables\n")
    flce.write_section(md, "## Fused linear cross-entropy\n\nflce table v1")
    moe.write_section(md, "moe table v1")
    assert main(["bench", "--only", "plan", "--repeats", "1", "--out", str(tmp_path)]) == 0
    text = md.read_text()
    assert "old bench tables" not in text and "plan / apply" in text  # the bench's own part is rewritten
    assert "flce table v1" in text and "### MoE experts\n\nmoe table v1" in text
    assert text.index("plan / apply") < text.index("flce table v1") < text.index("moe table v1")  # in their order
    moe.write_section(md, "moe table v2")  # each script still replaces only its own section
    assert main(["bench", "--only", "plan", "--repeats", "1", "--out", str(tmp_path)]) == 0
    text = md.read_text()
    assert "moe table v2" in text and "moe table v1" not in text and text.count("flce table v1") == 1
    assert text.count("<!-- moe:begin -->") == 1 and text.count("<!-- fused-linear-cross-entropy:begin -->") == 1
