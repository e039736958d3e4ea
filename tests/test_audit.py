"""``engine.audit``: someone else's patch judged with the verifier; the model and the process left as they were.

The patches here are written the way stacks write theirs (a class's ``forward`` replaced for the
whole process, a modeling module's function rebound, an instance forward bound), each wrong in
one declared way, so each finding and its explanation can be checked; Liger's own patching runs
for real (its Triton kernels under Triton's interpreter).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_for
from snapshots import assert_same, snapshot

import engine
from engine.auditing import audit, audit_many
from engine.commands.cli import main

ROOT = Path(__file__).resolve().parent.parent


def _one_plus_forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """Qwen3RMSNorm's forward with ``(1 + w)``: the guess that doubled Qwen3-8B's loss."""
    dtype = hidden_states.dtype
    x = hidden_states.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return (1.0 + self.weight) * x.to(dtype)


def wrong_class_forward(model: Any) -> None:
    """Process-wide, as twinkle's map does: the class's forward replaced."""
    from transformers.models.qwen3 import modeling_qwen3

    modeling_qwen3.Qwen3RMSNorm.forward = _one_plus_forward


def no_rope(model: Any) -> None:
    """Process-wide, as Liger and LlamaFactory do with rope: the modeling module's function rebound (to no rotation)."""
    from transformers.models.qwen3 import modeling_qwen3

    modeling_qwen3.apply_rotary_pos_emb = lambda q, k, cos, sin, unsqueeze_dim=1: (q, k)


def needs_cuda(model: Any) -> None:
    """An instance forward whose kernel cannot run here."""

    def forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this kernel needs a CUDA device")

    for m in model.modules():
        if type(m).__name__ == "Qwen3RMSNorm":
            m.forward = types.MethodType(forward, m)


def half_then_raise(model: Any) -> None:
    """Changes the process and the model, then fails (a stack that raises halfway)."""
    wrong_class_forward(model)
    needs_cuda(model)
    raise ValueError("unsupported model: no kernel for Qwen3Attention")


@pytest.fixture(scope="module")
def qwen3() -> torch.nn.Module:
    return tiny_for("qwen3").train()


def _process() -> dict[str, Any]:
    from transformers.models.qwen3 import modeling_qwen3

    return {"forward": modeling_qwen3.Qwen3RMSNorm.__dict__["forward"], "rope": modeling_qwen3.apply_rotary_pos_emb}


def test_a_patch_that_changes_nothing_is_reported_as_such_never_as_passing(qwen3) -> None:
    report = audit(qwen3, lambda model: None)
    assert report.verdict == "unchanged" and not report.rows
    assert report.model_checks and report.model_identical  # judged all the same: bit-identical
    assert "changed nothing this model runs" in report.summary()


def another_family(model: Any) -> None:
    """Process-wide, but for llama: a qwen3 model never reaches it."""
    from transformers.models.llama import modeling_llama

    modeling_llama.apply_rotary_pos_emb = lambda q, k, cos, sin, unsqueeze_dim=1: (q, k)


def test_a_change_this_model_cannot_reach_is_listed_and_put_back_never_passed(qwen3) -> None:
    from transformers.models.llama import modeling_llama

    before = modeling_llama.apply_rotary_pos_emb
    report = audit(qwen3, another_family)
    assert report.verdict == "unchanged" and report.model_identical
    assert [r.result for r in report.rows] == ["not in this model"]
    assert "does not reach" in report.summary()
    assert modeling_llama.apply_rotary_pos_emb is before


def test_a_patch_that_raises_reports_the_stacks_error_and_leaves_model_and_process_as_they_were(qwen3) -> None:
    before, process = snapshot(qwen3), _process()
    report = audit(qwen3, half_then_raise)
    assert report.verdict == "error"
    assert report.error == "ValueError: unsupported model: no kernel for Qwen3Attention"
    assert not report.rows and "raised ValueError" in report.summary()
    assert_same(before, snapshot(qwen3))
    assert _process() == process


def test_a_process_wide_class_forward_is_found_explained_and_put_back(qwen3) -> None:
    process = _process()
    report = audit(qwen3, wrong_class_forward)
    assert report.verdict == "differs"
    norms = [r for r in report.rows if r.cls == "Qwen3RMSNorm"]
    assert len(norms) == 9 and {r.change for r in norms} == {"class attribute replaced (process-wide)"}
    assert {r.result for r in norms} == {"differs"}
    assert all("computes scale: one_plus_weight where Qwen3RMSNorm.forward computes scale: weight (exactly)"
               == r.explanation for r in norms)
    assert all(r.ratio is not None and r.ratio > 100 for r in norms)
    assert not all(c.passed for c in report.model_checks)
    assert _process() == process  # the class's forward is the original again
    fresh = tiny_for("qwen3")
    assert type(fresh.model.norm).forward is process["forward"]


def test_a_rebound_module_function_is_judged_on_its_recorded_inputs_and_restored(qwen3) -> None:
    process = _process()
    report = audit(qwen3, no_rope)
    rope = [r for r in report.rows if r.change == "function rebound"]
    assert len(rope) == 1 and rope[0].path.endswith("modeling_qwen3.apply_rotary_pos_emb")
    assert rope[0].result == "differs" and rope[0].max_abs > 0
    assert report.verdict == "differs" and _process() == process


def test_a_kernel_that_cannot_run_is_unchecked_never_passed(qwen3) -> None:
    report = audit(qwen3, needs_cuda)
    norms = [r for r in report.rows if r.cls == "Qwen3RMSNorm"]
    assert norms and {r.result for r in norms} == {"unchecked"}
    assert "raised RuntimeError: this kernel needs a CUDA device" in norms[0].note
    assert report.model_problem is not None and "needs a CUDA device" in report.model_problem
    assert report.verdict == "unchecked"


def test_ours_passes_against_the_same_original_in_one_run(qwen3) -> None:
    ours, wrong = audit_many(qwen3, ["patchset:qwen3", wrong_class_forward])
    assert ours.verdict == "passes" and wrong.verdict == "differs"
    assert {r.cls for r in ours.rows if r.result == "same"} >= {"Qwen3RMSNorm", "Qwen3MLP"}
    assert not engine.is_patched(qwen3)


def test_a_module_imported_by_the_patch_is_restored_too() -> None:
    """twinkle's kernelize imports every family of its map, then sets forward on their classes."""
    script = """
import sys, torch
import engine
from engine.auditing import audit
from engine.commands.audit import tiny_model
name = "transformers.models.bloom.modeling_bloom"
assert name not in sys.modules
def patch(model):
    import importlib
    m = importlib.import_module(name)
    m.BloomMLP.forward = lambda self, *a, **k: None
    m.dropout_add = None
report = audit(tiny_model("qwen3").train(), patch)
m = sys.modules[name]
assert m.BloomMLP.forward.__qualname__ == "BloomMLP.forward", m.BloomMLP.forward
assert m.dropout_add is not None
print(report.verdict, sorted(r.path for r in report.rows))
"""
    done = subprocess.run([sys.executable, "-c", script], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "BloomMLP" in done.stdout and "dropout_add" in done.stdout


def test_cli_audit_exit_codes_unchanged_and_could_not_run(capsys: pytest.CaptureFixture[str]) -> None:
    """0: passes or unchanged (bit-identical); 3: the patch raised (the stack's error), never 1 (differs)."""
    assert main(["audit", "qwen3", "--with", "tests/test_audit_adversarial.py:copied_head"]) == 0
    assert main(["audit", "qwen3", "--with", "tests/test_audit.py:half_then_raise"]) == 3
    out = capsys.readouterr().out
    assert "passes" in out and "error" in out


def test_cli_audit_json_and_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["audit", "qwen3", "--with", "tests/test_audit.py:wrong_class_forward", "--with", "patchset:qwen3",
                 "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 1
    assert [a["verdict"] for a in data["audits"]] == ["differs", "passes"]
    assert any("scale: one_plus_weight" in r["explanation"] for r in data["audits"][0]["rows"])


def test_cli_audit_refuses_an_unknown_patch(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["audit", "qwen3", "--with", "nothing-of-the-sort"]) == 2
    assert "not a stack" in capsys.readouterr().err


@pytest.mark.slow
def test_liger_olmo2_bf16_differs_by_its_casting_mode(capsys: pytest.CaptureFixture[str]) -> None:
    """``patch-engine audit olmo2 --with liger --dtype bf16``: Liger's llama casting on OLMo 2's fp32-cast norm."""
    pytest.importorskip("liger_kernel")
    assert main(["audit", "olmo2", "--with", "liger", "--dtype", "bf16"]) == 1
    out = capsys.readouterr().out
    # the finding with its distance: "differs: Olmo2RMSNorm differs (2.4x): computes cast: llama where ..."
    assert re.search(r"differs: Olmo2RMSNorm differs \([0-9.]+x\): computes cast: llama where "
                     r"Olmo2RMSNorm\.forward computes cast: fp32 \(exactly\)", out), out
    from transformers.models.olmo2 import modeling_olmo2

    assert modeling_olmo2.Olmo2RMSNorm.__module__ == modeling_olmo2.__name__  # Liger's rebinding put back
    assert modeling_olmo2.apply_rotary_pos_emb.__module__ == modeling_olmo2.__name__


def _differing(evidence: str) -> Any:
    from engine.auditing.report import AuditReport, Row

    row = Row("model.layers.0.input_layernorm", "Qwen3RMSNorm", "forward replaced", "", "differs", 1e-3, 1.4,
              explanation="computes cast: fp32 where Qwen3RMSNorm.forward computes cast: llama (exactly)",
              evidence=evidence)
    return row, AuditReport


@pytest.mark.parametrize(("reading", "evidence", "apart"), [
    ("the torch_npu emulator", "rounding order", True),    # where an emulated op rounds: the emulator's guess
    ("Triton's interpreter", "rounding order", False),     # the kernel's own casts, run as written
    ("the torch_npu emulator", "exact arithmetic", False),  # another scale or activation: no reading decides that
    ("Triton's interpreter", "", True),                    # a kernel's numbers, not another declaration
    ("", "", False),                                        # a user's torch code: what this CPU computes
])
def test_a_finding_that_rests_on_a_reading_is_labelled_and_kept_apart(reading: str, evidence: str, apart: bool) -> None:
    row, report_cls = _differing(evidence)
    report = report_cls("p", "Qwen3ForCausalLM", "qwen3", "bf16", rows=[row], reading=reading)
    assert report.verdict == "differs" and report.reading_only is apart
    assert ("reading only" in report.summary()) is apart


def test_the_audits_tiny_moe_models_have_no_dense_layer_as_released_checkpoints() -> None:
    from engine.commands.audit import tiny_model

    model = tiny_model("qwen3_moe")
    assert model.config.mlp_only_layers == []
    assert {type(layer.mlp).__name__ for layer in model.model.layers} == {"Qwen3MoeSparseMoeBlock"}


def test_a_whole_model_difference_no_module_explains_is_never_put_down_to_a_reading() -> None:
    """Liger's granite logits 7.6e5x off under Triton's interpreter, every module passing: not located, so not
    'on Triton's interpreter's reading only', and bolded as any finding."""
    from engine.auditing.report import AuditReport, Row
    from engine.verification.results import Check

    row = Row("model.norm", "GraniteRMSNorm", "forward replaced", "", "passes", 1e-7, 1.2)
    logits = Check("<model>", "GraniteForCausalLM", "-", "logits", "fp32", 0.4, 0.1, False)
    report = AuditReport("liger", "GraniteForCausalLM", "granite", "fp32", rows=[row], model_checks=[logits],
                         reading="Triton's interpreter")
    assert report.verdict == "differs" and not report.reading_only
    assert "reading only" not in report.summary() and "logits differs" in report.summary()


def test_a_module_given_a_cache_is_judged_on_the_cache_as_it_was_when_called() -> None:
    """A composite model (LLaVA's language model: ``use_cache`` on in training) hands each attention the run's cache,
    which the run goes on to fill. Recorded by reference, the attention run again saw its own keys twice (48 keys for
    16 queries) and our own patchset's attention rows were 'unchecked'; each run now gets a copy of the cache as it
    was when the attention was called."""
    from engine.commands.audit import tiny_model

    report = audit(tiny_model("llava", torch.float32).train(), "patchset:llava")
    attention = [r for r in report.rows if r.cls == "LlamaAttention"]
    assert attention and all(r.result == "same" for r in attention), report.summary()
    assert report.verdict == "passes"
    assert not [r for r in report.rows if r.result == "unchecked"], report.summary()
