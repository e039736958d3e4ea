"""Outputs that read right: what a command did not do is said, not shown as a zero; a usage error
writes nothing; a timing ratio says what it means; a failure names its cause once.
"""

from __future__ import annotations

import io
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from engine.commands.cli import main


def _run(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue() + err.getvalue()


def test_coverage_no_verify_says_what_it_did_not_check(tmp_path: Path) -> None:
    # before: "**0** of the 289 ... are patched and verified (0%)", a verdict nobody measured
    page = tmp_path / "coverage.md"
    code, shown = _run(["coverage", "llama", "gpt2", "--no-verify", "--out", str(page),
                        "--measured", str(tmp_path / "none.json")])
    text = page.read_text()
    assert code == 0
    # its progress, a line a type where stderr is no terminal (a bar on one; none with --quiet)
    assert re.search(r"^coverage 1/2 \(\d+ s\): gpt2: no bundled patchset$", shown, re.MULTILINE), shown
    assert re.search(r"^coverage 2/2 \(\d+ s\): llama: not verified \(--no-verify\)$", shown, re.MULTILINE)
    assert "patched and verified (" not in text and "**0**" not in text
    assert "- The 1 of the 2 causal-LM and image-text-to-text types of transformers" in text
    assert "with a bundled patchset are **not verified by this run** (`--no-verify`;" in text
    assert "`patch-engine verify` not run on them (verifies: `-`)" in text


def test_bench_rejects_an_unknown_section_lists_the_valid_ones_and_writes_nothing(tmp_path: Path) -> None:
    # before: exit 0 and an empty cpu.json / cpu.md / cpu.png
    out = tmp_path / "results"
    code, text = _run(["bench", "--only", "nope,plan", "--out", str(out)])
    assert code == 2 and not out.exists()
    assert "unknown section 'nope'; the sections: ops, overhead, plan, train" in text


def test_bench_says_which_section_it_measured(tmp_path: Path) -> None:
    code, text = _run(["bench", "--only", "overhead", "--repeats", "1", "--out", str(tmp_path)])
    assert code == 0 and re.search(r"^bench 1/1 \(\d+ s\): overhead measured$", text, re.MULTILINE), text
    code, text = _run(["bench", "--only", "overhead", "--repeats", "1", "--out", str(tmp_path), "--quiet"])
    assert code == 0 and "overhead measured" not in text


def test_the_demos_ratio_says_what_it_means_on_a_cpu() -> None:
    from engine.commands.demo import ratio_note

    cpu = ratio_note("cpu")
    assert "unpatched time / patched time" in cpu and "not a kernel's speed-up" in cpu
    assert "docs/performance.md" in cpu and (Path(__file__).parent.parent / "docs" / "performance.md").exists()
    assert "not a kernel's speed-up" not in ratio_note("cuda")


def test_a_wrong_scale_names_the_declaration_once_and_its_consequences_as_such() -> None:
    """The flipped norm: the declaration is the cause; its kernel's difference (returned in fp32 where the
    original returns bf16) and the whole model's follow from it, and are not listed as mistakes of their own."""
    import engine
    from engine.kernels import registry
    from engine.loader import load_patchset
    from engine.tiny import build_tiny_model
    from engine.verification.results import CONSEQUENCE, failure_message

    # a kernel other than `torch` (whose check *is* the declaration's): the torch reference under another name
    registry.register(registry.KernelProvider(name="reference_copy", op="rms_norm", devices=registry.ALL_DEVICES,
                                              build=registry.get("torch", "rms_norm").build))
    try:
        data = load_patchset("qwen3").model_dump(mode="json", exclude_none=True)
        data["patches"][0].update(scale="one_plus_weight", kernel="reference_copy")
        model = build_tiny_model("qwen3", dict(load_patchset("qwen3").tiny_model.config))
        report = engine.verify(model, data, device="cpu", raise_on_failure=False)
    finally:
        registry.unregister("reference_copy", "rms_norm")
    assert any(c.what == "kernel" and not c.passed and "where the original's is bf16" in c.note for c in report.checks)
    message = failure_message(report)
    lines = message.splitlines()[1:]
    assert len(lines) == 2, message
    assert "declaration of rms_norm failed" in lines[0] and "scale: weight fits" in lines[0]
    assert lines[1].startswith("  as a result of the declaration failure above, their kernels and the whole model")
    assert "where the original's is" not in message
    table = report.table()
    assert "where the original's is" not in table and CONSEQUENCE in table


def test_the_readmes_verify_example_is_what_the_command_prints(monkeypatch) -> None:
    """README's ``$ patch-engine verify qwen3`` block, line by line (``...`` elides), as a user's run prints it."""
    monkeypatch.setenv("PATCH_ENGINE_COMPILE", "1")  # a user's default (the suite turns compiled kernels off)
    monkeypatch.delenv("PATCH_ENGINE_CONDITIONS", raising=False)  # ... and every condition of use (the suite: none)
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block = re.search(r"```console\n\$ patch-engine verify qwen3\n(.*?)```", readme, re.DOTALL)
    assert block is not None
    code, shown = _run(["verify", "qwen3"])
    assert code == 0
    printed = [" ".join(line.split()) for line in shown.splitlines()]
    for line in block[1].splitlines():
        if line.strip() == "...":
            continue
        pattern = re.escape(" ".join(line.split())).replace(re.escape("..."), ".*")
        assert any(re.fullmatch(pattern, got) for got in printed), f"README shows {line!r}; the command printed:\n{shown}"


def test_progress_is_quiet_with_quiet() -> None:
    from engine.commands.steps import Steps

    stream = io.StringIO()
    with Steps(2, "coverage", quiet=True, stream=stream) as steps:
        steps.step("a")
    assert stream.getvalue() == "" and steps.done == 1
