"""The benchmark script runs and writes its JSON and chart (a smoke run; no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from engine.commands.cli import main


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


def test_bench_a_checkpoint_folder_side_by_side(tmp_path: Path) -> None:
    """``--model PATH`` (as ``--checkpoint smollm2`` / ``--gguf FILE``): train step, forwards and greedy decodes,
    unpatched vs patched (and patched + fused head for the step), in one run; every patched number is set
    against the unpatched one of the same work."""
    from engine.tiny import build_tiny_model

    folder = tmp_path / "tiny-llama"
    build_tiny_model("llama", {"tie_word_embeddings": True}, seed=0).save_pretrained(folder)
    out = tmp_path / "results"
    argv = ["bench", "--model", str(folder), "--train-seq", "24", "--forward-seq", "8", "16", "--decode-prompts", "1",
            "--new-tokens", "3", "--repeats", "1", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads((out / "checkpoint_tiny_llama_cpu.json").read_text())
    assert result["patchset"] == "llama" and result["model_type"] == "llama"
    rows = {(r["work"], r["seq"], r["variant"]): r for r in result["rows"]}
    patched = ("unpatched", "patched")
    assert set(rows) == ({("train", 24, v) for v in (*patched, "patched + fused head")}
                         | {("forward", n, v) for n in (8, 16) for v in patched} | {("decode", 1, v) for v in patched})
    for (work, seq, variant), r in rows.items():
        base = rows[(work, seq, "unpatched")]
        assert r["seconds"] > 0 and len(r["times"]) == 1
        assert r["time_vs_unpatched"] == r["seconds"] / base["seconds"]
        if work == "train" or (work, seq) == ("forward", 16):  # memory: the step and the longest forward
            assert r["peak_rise_MiB"] > 0 and r["peak_vs_unpatched"] == r["peak_rise_MiB"] / base["peak_rise_MiB"]
        else:
            assert r["peak_rise_MiB"] is None
        if work == "train":  # the same step: the patched losses are the unpatched one's
            assert r["loss_diff_vs_unpatched"] == abs(r["loss"] - base["loss"]) <= 1e-5
        if work == "decode":  # the torch reference (compiled kernels are off in the suite): the same tokens
            assert r["same_tokens"] is True
    # the fused head never forms the [24, vocab] logits: its step's peak is below the unpatched one's
    assert rows[("train", 24, "patched + fused head")]["peak_rise_MiB"] < rows[("train", 24, "unpatched")]["peak_rise_MiB"]
    text = (out / "cpu.md").read_text()
    assert "<!-- checkpoint-tiny_llama:begin -->" in text and "patched + fused head" in text
    assert "greedy decode, 1-token prompt" in text and "load average" in text
    assert "patch-engine bench --model" in text  # the command that reproduces it


def test_bench_a_checkpoint_refuses_a_folder_without_a_model(tmp_path: Path, capsys) -> None:
    assert main(["bench", "--model", str(tmp_path), "--out", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert not (tmp_path / "cpu.md").exists()
