"""The hf-suite harness (tests/hf_suite/): its judgement of a patched run and the activation switch.

The harness itself runs transformers' test files (minutes each, under another transformers
release: tests/hf_suite/run.py); here are the parts that decide what its results say, on runs
written as the plugin writes them, and the activation switch on real transformers configs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "hf_suite"))
import report


def _run(tests: dict[str, tuple[str, str]], *, patched: int = 3, mode: str = "torch", **models: Any) -> dict[str, Any]:
    return {"mode": mode, "exitstatus": 1 if any(o == "failed" for o, _ in tests.values()) else 0, "wall_s": 1.0,
            "models": {"built": 3, "patched": patched, "refused": {}, "no_patchset": {}, "crashed": {}, "kernels": {},
                       "warnings": {}, "activations": {}, **models},
            "compiled": {}, "tests": {k: {"outcome": o, "message": m} for k, (o, m) in tests.items()}}


OFF = _run({"t::a": ("passed", ""), "t::b": ("failed", "OSError: no hub"), "t::c": ("skipped", "needs CUDA"),
            "t::d": ("xfailed", "known")}, mode="off")


def test_the_same_outcomes_are_no_difference_and_counts_cover_the_selection() -> None:
    patched = _run({"t::a": ("passed", ""), "t::b": ("failed", "OSError: no hub, other text")})
    row = report.compare(OFF, patched)
    assert row["differences"] == []
    assert row["unpatched"] == row["patched"] == {"passed": 1, "failed": 1, "skipped": 0, "xfailed": 0, "xpassed": 0}


@pytest.mark.parametrize(("b", "d", "what"), [
    (("failed", "OSError: no hub"), ("failed", "AssertionError: Unexpected state"), "t::d"),  # xfailed -> failed
    (("failed", "AssertionError: 3 != 4"), ("xfailed", "known"), "t::b"),  # the same test failing another way
])
def test_a_changed_outcome_or_another_exception_is_a_difference(b: tuple[str, str], d: tuple[str, str], what: str) -> None:
    patched = _run({"t::a": ("passed", ""), "t::b": b, "t::c": ("skipped", "needs CUDA"), "t::d": d})
    differences = report.compare(OFF, patched)["differences"]
    assert [x["test"] for x in differences] == [what]


def test_a_test_missing_from_one_run_is_a_difference() -> None:
    patched = _run({"t::a": ("passed", ""), "t::e": ("passed", "")})
    assert [(d["test"], d["unpatched"]) for d in report.compare(OFF, patched)["differences"]] == [("t::e", "not run")]


def test_a_subtest_failure_is_judged_by_its_exception() -> None:
    assert report._exception("subtest [x] (i=1): AssertionError: Tensor-likes are not close") == "AssertionError"
    assert report._exception("torch._dynamo.exc.Unsupported: graph break") == "torch._dynamo.exc.Unsupported"


def test_nothing_patched_a_crash_or_a_dead_pytest_is_a_harness_failure() -> None:
    ok = _run({"t::a": ("passed", "")})
    assert report.problems(OFF, ok) == []
    assert "nothing patched" in report.problems(OFF, _run({"t::a": ("passed", "")}, patched=0))[0]
    crashed = _run({"t::a": ("failed", "KeyError: x")}, crashed={"qwen3 on Qwen3Model: KeyError: x": 1})
    assert "engine.apply raised" in report.problems(OFF, crashed)[0]
    dead = {**ok, "exitstatus": 3}
    assert "did not finish" in report.problems(OFF, dead)[0]


def test_the_page_lists_every_difference_and_refusal() -> None:
    patched = _run({"t::a": ("failed", "AssertionError: x"), "t::b": ("failed", "OSError: no hub")},
                   refused={"qwen3 on Qwen3Model: SignatureMismatch: act_fn": 2}, kernels={"rms_norm:torch": 3})
    summary = {"rows": [report.summarize("qwen3", "torch", OFF, patched)], "environment": "here"}
    page = report.render(summary, "# title")
    assert "| qwen3 | torch | 1 / 1 / 0 | 0 / 2 / 0 | 3 of 3 (2 refused) | rms_norm torch |" in page
    assert "`a`: passed unpatched, failed patched: AssertionError: x" in page
    assert "SignatureMismatch: act_fn: 2x" in page
    assert "- qwen3 (torch) `b`: OSError: no hub" in page.split("## Failing unpatched too")[1]  # transformers'
    assert "`a`" not in page.split("## Failing unpatched too")[1]  # a difference is not listed as transformers'


def test_the_activation_switch_sets_the_family_default_in_configs_and_sub_configs() -> None:
    """The testers' ``gelu`` becomes the family's own activation; types without a patchset keep theirs."""
    transformers = pytest.importorskip("transformers")
    import hf_suite_plugin

    qwen3 = transformers.Qwen3Config(hidden_act="gelu")
    hf_suite_plugin._family_activation(qwen3)
    assert qwen3.hidden_act == "silu"
    gemma3 = transformers.Gemma3Config(text_config={"hidden_activation": "gelu"}, vision_config={"hidden_act": "gelu"})
    hf_suite_plugin._family_activation(gemma3)
    assert gemma3.text_config.hidden_activation == "gelu_pytorch_tanh"
    assert gemma3.vision_config.hidden_act == "gelu"  # siglip_vision_model: no bundled patchset, untouched
    pixtral = transformers.PixtralVisionConfig(hidden_act="gelu")  # the config's default; checkpoints say silu
    hf_suite_plugin._family_activation(pixtral)
    assert pixtral.hidden_act == "silu"  # what the pixtral patchset's tiny model declares


def test_results_files_name_the_whole_file_and_other_selections_apart_from_the_modes_own() -> None:
    """A whole-file run and the mode's own selection must not share a results file (a resumed sweep would
    take one for the other)."""
    import run

    assert run.Run("mistral", "torch", run.SELECTIONS["torch"]).name == "mistral-torch"
    assert run.Run("mistral", "torch").name == "mistral-torch-all"
    other = run.Run("mistral", "torch", "test_save_load").name
    assert other.startswith("mistral-torch-k") and other not in ("mistral-torch", "mistral-torch-all")
    assert run.Run("qwen3", "interpret", run.INTERPRET_SELECTION, patchset="qwen3_flce").name == \
        "qwen3-interpret-qwen3_flce"


def test_the_sweep_status_counts_a_family_only_for_its_modes_selection_or_the_whole_file() -> None:
    """A row of another selection (the CI's, a narrower -k) does not make a family swept in that mode."""
    ok = _run({"t::a": ("passed", "")})
    row = lambda family, mode, selection: {**report.summarize(family, mode, OFF, ok), "selection": selection}
    summary = {"rows": [row("qwen3", "torch", "sweep"), row("llama", "torch", ""), row("gemma3", "torch", "narrow"),
                        row("qwen3", "compiled", "narrow")]}
    page = report.render(summary, "# title", ["gemma3", "llama", "qwen3"], {"torch": "sweep", "compiled": "train"})
    assert "- `torch` (the sweep's selection; the whole file for 1): 2 of 3 families swept; not yet: gemma3." \
        in page
    assert "- `compiled` (the sweep's selection; the whole file for 0): 0 of 3 families swept" in page
    assert "| llama | torch (whole file) |" in page and "| gemma3 | torch (-k: its own selection) |" in page


def test_a_file_whose_every_test_skips_both_ways_is_no_test_not_a_pass_nor_a_harness_failure() -> None:
    """llama4's 5.15.1 file holds only integration tests that need a large accelerator: nothing to compare."""
    skip = {"t::a": ("skipped", "needs a large accelerator"), "t::b": ("skipped", "slow")}
    row = report.summarize("llama4", "torch", _run(skip, mode="off", built=0, patched=0), _run(skip, built=0, patched=0))
    assert row["problems"] == [] and "every test of the file skips here, both ways (2; first: needs a large" in row["no_tests"]
    page = report.render({"rows": [row]}, "# title")
    assert "| no test runs here (below) |" in page and "| same |" not in page
    ran = report.summarize("llama4", "torch", OFF, _run({"t::a": ("passed", "")}, built=0, patched=0))
    assert "nothing patched" in ran["problems"][0]  # a test ran on no patched model: still a harness failure


def test_a_selection_that_holds_no_test_of_the_file_is_no_test_not_a_harness_failure() -> None:
    """llama4's file has no training tests: the compiled mode's selection collects nothing (pytest exit 5)."""
    empty = {**_run({}, built=0, patched=0), "mode": "compiled", "exitstatus": 5}
    row = report.summarize("llama4", "compiled", OFF, empty)
    assert row["problems"] == [] and "collected none" in row["no_tests"]
    dead = {**_run({}, built=0, patched=0), "mode": "compiled", "exitstatus": 3}  # pytest itself failed
    assert report.summarize("llama4", "compiled", OFF, dead)["problems"]
