"""Coverage's second column (transformers' test configs): the command on a few types, and the committed page.

The full sweep is a command (``python -m engine.commands.coverage_testers``: every generative type, minutes
on 2 cores); here it runs on four types whose classification is known, and the committed data
(benchmarks/results/coverage_testers.json) is checked against the section it renders in docs/coverage.md.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.commands import coverage_testers as ct
from engine.commands.tester_tree import TARBALL, TESTS_DIR

needs_tree = pytest.mark.skipif(not TARBALL.is_file() and not (TESTS_DIR / "tests").is_dir(),
                                reason=f"transformers' test tree is not here ({TARBALL})")


@pytest.fixture(scope="module")
def swept(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, dict]:
    """llama (dense, GELU MLP under its tester), qwen3_moe (experts), llava (a composite: vision tower, projector and
    language model patched whole), and a type newer than the test tree (no tester)."""
    data = tmp_path_factory.mktemp("testers") / "data.json"
    code = ct.main(["llama", "qwen3_moe", "llava", "apertus1p5", "--data", str(data), "--no-doc", "--quiet",
                    "--timeout", "400"])
    return code, json.loads(data.read_text())


@pytest.mark.slow
@needs_tree
def test_the_command_classifies_each_type(swept: tuple[int, dict]) -> None:
    code, data = swept
    types = data["types"]
    assert code == 0  # nothing patched wrong, no engine error
    assert {t: e["result"] for t, e in types.items()} == {
        "llama": "patched exactly", "qwen3_moe": "patched exactly", "llava": "patched exactly",
        "apertus1p5": "tester does not build"}
    llama, moe, llava = types["llama"], types["qwen3_moe"], types["llava"]
    assert llama["class"] == "LlamaForCausalLM" and {"rms_norm", "rope"} <= set(llama["ops"])
    assert "moe_experts" in moe["ops"]
    # the composite, not its language model: its vision tower's layer norms are patched too
    assert llava["class"] == "LlavaForConditionalGeneration" and {"layer_norm", "rms_norm"} <= set(llava["ops"])
    for entry in (llama, moe, llava):
        assert set(entry["checks"]) == {"logits", "loss", "after_step"}
        assert float(entry["step_moved"]) > 0.01  # the training step changed the model, so "after_step" says something
    assert types["apertus1p5"]["reason"].startswith("no test file")
    assert data["transformers"] and data["sweep"]["types_measured"] == 4  # every type of its data: a whole sweep


def test_a_hang_or_crash_is_blamed_on_the_part_that_ran() -> None:
    in_engine = ct._lost("llama", "engine", "timed out after 600 s", 600.0)
    assert in_engine["result"] == "engine error" and in_engine["error"]["type"] == "Timeout"
    in_tester = ct._lost("llama", "tester", "the worker process died (exit -9): Killed", 3.0)
    assert in_tester["result"] == "tester does not build" and "exit -9" in in_tester["reason"]


def test_the_section_goes_between_its_markers(tmp_path: Path) -> None:
    doc = tmp_path / "coverage.md"
    doc.write_text("# Coverage\n\n| a | b |\n")
    data = {"transformers": "5.25.0", "torch": "2.13", "lr": 0.1, "types": {
        "llama": {"result": "patched exactly", "class": "LlamaForCausalLM", "ops": ["rms_norm"],
                  "checks": {"logits": "bit-equal"}},
        "blip": {"result": "nothing patched", "class": "BlipForConditionalGeneration",
                 "reason": "measuring a tiny copy of BlipForConditionalGeneration failed: TypeError: x"}}}
    ct.write_section(ct.render_section(data), doc)
    assert ct.check_section(data, doc) == ""
    ct.write_section(ct.render_section(data), doc)  # again: replaced, not appended
    text = doc.read_text()
    assert text.count(ct.BEGIN) == 1 and text.startswith("# Coverage\n\n| a | b |\n")
    assert "**1** patched exactly" in text and "1 are the engine's own tiny copy of the model failing" in text
    # the rows do not start with "| ": the first table's readers (tests/test_docs.py, coverage.rows_from_page)
    assert not any(line.startswith("| ") for line in text.split(ct.BEGIN)[1].splitlines())
    data["types"]["llama"]["result"] = "patched wrong"
    assert "differs" in ct.check_section(data, doc)


def test_the_committed_data_and_page_agree() -> None:
    """docs/coverage.md's section is what the committed data renders; every type not patched says why."""
    data = ct.load(ct.DATA)
    assert data["types"], f"no data: run python -m engine.commands.coverage_testers ({ct.DATA})"
    assert ct.check_section(data, ct.DOC) == ""
    for model_type, entry in data["types"].items():
        assert entry["result"] in ct.RESULTS, model_type
        if entry["result"] != "patched exactly":
            assert entry.get("reason"), f"{model_type}: {entry['result']} without a reason"
        if entry["result"] == "engine error":
            assert entry["error"]["type"] and entry["error"]["message"], model_type


def test_regenerating_the_first_column_keeps_this_section(tmp_path: Path) -> None:
    """``patch-engine coverage --out docs/coverage.md`` rewrites the page; the second column's section stays."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from engine.commands.cli import main

    doc = tmp_path / "coverage.md"
    section = ct.render_section({"transformers": "5.25.0", "types": {"llama": {"result": "patched exactly"}}})
    doc.write_text("# an older page\n\n" + section + "\n")
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        assert main(["coverage", "llama", "--no-verify", "--out", str(doc)]) == 0
    text = doc.read_text()
    assert "# an older page" not in text and "| llama | llama | - |" in text
    assert text.count(ct.BEGIN) == 1 and section in text
