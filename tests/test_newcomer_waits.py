"""What a newcomer reads and waits for: the long commands say what runs as it runs, their tables fit 120 columns,
a refusal speaks the command line's flags, and a dry run for a device this machine lacks plans for it.

Each through the real command line (``main``) on a tiny model: the real checkpoints' runs are minutes long and
covered elsewhere (tests/test_real_checkpoints.py); the progress is the same mechanism on any model.
"""

from __future__ import annotations

import importlib.util
import io
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from engine.commands.cli import main
from engine.planning.tables import TABLE_WIDTH

LINE = r"\(\d+ s\): "


def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()  # not terminals: progress comes as lines, as in a CI log
    with redirect_stdout(out), redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _widest(text: str) -> int:
    return max(len(line) for line in text.splitlines())


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama saved as a from_pretrained folder, with a word-level tokenizer of the bundled text's words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from engine.commands.checkpoint import default_text
    from engine.tiny import build_tiny_model

    folder = tmp_path_factory.mktemp("tiny_llama")
    model = build_tiny_model("llama")
    words = list(dict.fromkeys(re.findall(r"\w+|[^\w\s]", default_text())))[:model.config.vocab_size - 1]
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)
    model.save_pretrained(folder)
    return folder


def test_verify_on_a_checkpoint_says_each_step_and_fits_120_columns(tiny_checkpoint: Path) -> None:
    from engine.commands.checkpoint import STEPS

    code, out, err = _run(["verify", "llama", "--model", str(tiny_checkpoint), "--max-tokens", "32",
                           "--mode", "training"])
    assert code == 0, out + err
    total = len(STEPS)
    assert re.search(rf"^verify 0/{total} {LINE}loading tiny_llama", err, re.MULTILINE), err
    expected = [rf"loaded tiny_llama\w* \(LlamaForCausalLM, fp32\), 32 tokens", r"perplexity unpatched [0-9.]+",
                r"patched \d+ modules and functions; next the original's run and its fp64 truth, then each module "
                r"checked, then the whole model",
                r"modules checked (\d+)/\1", "the whole model checked: logits, loss and every gradient",
                r"perplexity patched [0-9.]+"]
    done = [re.search(rf"^verify (\d)/{total} {LINE}(.*)$", line) for line in err.splitlines()]
    steps: dict[int, str] = {}
    for m in filter(None, done):
        steps.setdefault(int(m[1]), m[2])  # the line that finished the step; notes repeat its count after it
    for i, pattern in enumerate(expected, 1):
        assert re.fullmatch(pattern, steps.get(i, "")), f"step {i}: {steps.get(i)!r} is not {pattern!r}\n{err}"
    table = "\n".join(line for line in out.splitlines() if not line.startswith(("verify '", "verification ")))
    assert _widest(table) <= TABLE_WIDTH, out  # its sentences are prose (a terminal wraps them at words); the table fits
    # grouped by class: the class, op and kernel head their modules once
    assert re.search(r"^LlamaRMSNorm: rms_norm, kernel \S+.*; \d+ modules$", out, re.MULTILINE), out
    assert re.search(r"^  model\.layers\.0\.mlp\s+0\s", out, re.MULTILINE), out

    code, out, err = _run(["verify", "llama", "--model", str(tiny_checkpoint), "--max-tokens", "32", "-q"])
    assert code == 0 and not re.search(r"^verify \d", err, re.MULTILINE), err


def test_audit_says_the_original_and_each_patch_and_fits_120_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATCH_ENGINE_AUDIT_CONDITIONS", "length 17,left padding")
    code, out, err = _run(["audit", "llama", "--with", "patchset:llama", "--with", "patchset:llama"])
    assert code == 0, out + err
    total = 3 + 2 + 2  # the model, the original's probe and modules, 2 conditions, 2 patches
    for line in ("0/{t} {s}building a tiny llama", "1/{t} {s}model: a tiny llama \\(LlamaForCausalLM\\)",
                 "2/{t} {s}the original: the model and its fp64 truth",
                 "3/{t} {s}the original: \\d+ modules and functions and their fp64 truth",
                 "4/{t} {s}the original under length 17", "5/{t} {s}the original under left padding",
                 "5/{t} {s}patchset llama \\(engine.apply\\): patched \\([0-9.]+ s\\)",
                 "5/{t} {s}patchset llama \\(engine.apply\\): the whole model judged under left padding",
                 "6/{t} {s}patchset llama \\(engine.apply\\): passes", "7/{t} {s}patchset llama \\(engine.apply\\): passes"):
        pattern = "^audit " + line.format(t=total, s=LINE) + "$"
        assert re.search(pattern, err, re.MULTILINE), f"{pattern}\n{err}"
    tables = [line for line in out.splitlines() if not line.startswith(("audit on", "patchset llama"))]
    assert max(map(len, tables)) <= TABLE_WIDTH, out  # a verdict's summary is a sentence; its table fits
    assert re.search(r"^    what it computes / note: grads \[left padding\]: ", out, re.MULTILINE), out

    code, out, err = _run(["audit", "llama", "--with", "patchset:llama", "--quick", "-q"])
    assert code == 0 and "audit 1/" not in err, err


def test_a_wide_table_fits_and_keeps_every_word() -> None:
    """The columns give way in the documented order (engine.planning.tables); no cell loses a character."""
    from engine.commands.verify_table import verify_table
    from engine.planning.tables import format_table
    from engine.verification.results import MODEL, Check, VerifyReport

    long_path = "model.language_model.layers.10.self_attn.post_attention_layernorm_with_a_long_name"
    note = "272 parameter gradients; largest difference: " + "a long note " * 12
    rows = [(long_path, "Qwen3VLTextRMSNorm", "rms_norm", "compiled (fp32: torch)", "0", "7.8e-03 / 2.3e-02", "ok",
             note), ("<model> grads", "Qwen3VLForConditionalGeneration", "-", "-", "0", "-", "ok", "")]
    headers = ("module", "class", "op", "kernel", "fp32 diff / allowed", "bf16 diff / allowed", "result", "note")
    assert _widest(format_table(headers, rows)) > TABLE_WIDTH  # one line a row without a width: the API's
    text = format_table(headers, rows, width=TABLE_WIDTH)
    assert _widest(text) <= TABLE_WIDTH, text
    for cell in (*rows[0], *rows[1], *headers):  # a wrapped cell breaks only between its parts
        assert all(part in text for part in re.split(r"[ ._/]", cell)), cell

    report = VerifyReport(checks=[
        Check(long_path, "Qwen3VLTextRMSNorm", "rms_norm", "kernel", dt, 0.01, 0.01, True, "", "compiled", 0.05)
        for dt in ("fp32", "bf16")] + [Check(MODEL, "Qwen3VLForConditionalGeneration", "-", "grads", "fp32", 0.0, 0.0,
                                             True, note)])
    for detail in (False, True):
        table = verify_table(report, detail=detail)
        assert _widest(table) <= TABLE_WIDTH, table
        assert all(part in table for part in re.split(r"[._]", long_path)) and "Qwen3VLTextRMSNorm: rms_norm" in table


def test_refusals_on_the_command_line_name_its_flags(tmp_path: Path) -> None:
    """A release outside a patchset's range: the CLI says --unverified refuse / trust / verify; Python keeps keywords."""
    import engine
    from engine.errors import VersionMismatch
    from engine.tiny import build_tiny_model

    old = tmp_path / "old.yaml"
    old.write_text("name: oldqwen\nmodel_types: [qwen3]\nrequires: {transformers: \"<4.0\"}\npatches:\n"
                   "  - {target: Qwen3RMSNorm, op: rms_norm, scale: weight, eps_attr: variance_epsilon, cast: llama}\n")
    code, out, err = _run(["plan", str(old), "--unverified", "refuse"])
    assert code == 1
    assert "nothing was patched (--unverified refuse)" in err, err
    assert "(--unverified verify, the default; $PATCH_ENGINE_UNVERIFIED=verify)" in err, err
    assert "unverified=" not in err, err
    code, out, err = _run(["plan", str(old), "--unverified", "trust"])
    assert code == 0 and "apply patches it without verifying (--unverified trust)" in out, out
    assert "unverified=" not in out + err
    with pytest.raises(VersionMismatch, match=r"nothing was patched \(unverified='refuse'\)"):
        engine.plan(build_tiny_model("qwen3"), str(old), unverified="refuse")


def test_a_dry_run_for_a_device_this_machine_lacks_plans_for_it() -> None:
    """plan --model-type gpt2 --device cuda on a CPU: the measured declarations planned for cuda (liger's kernels),
    verified here; it said before 'patched nothing ... AssertionError: Torch not compiled with CUDA enabled'."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has cuda: the dry run verifies there")
    code, out, err = _run(["plan", "--model-type", "gpt2", "--device", "cuda"])
    assert code == 0, out + err
    assert "could not run" not in out + err and "CUDA enabled" not in out + err
    if importlib.util.find_spec("liger_kernel") is not None:  # the cuda extra: auto picks liger's kernel
        assert re.search(r"^LayerNorm\s+layer_norm\s+liger\s+patch\s+\d+", out, re.MULTILINE), out
    else:  # the README's install ([dev] alone): torch, with the extra that would give liger named
        assert re.search(r"^LayerNorm\s+layer_norm\s+torch\s+patch\s+\d+", out, re.MULTILINE), out
        said = " ".join(out.split())  # the why column wraps
        assert "liger-kernel is not installed" in said and 'pip install "patch-engine[cuda]"' in said, out
    assert "this machine has no cuda, so the measured declarations were verified on a tiny copy here (cpu" in out
