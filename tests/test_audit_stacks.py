"""Each named stack's own patching, audited where that stack is installed (skipped elsewhere).

twinkle and LlamaFactory live in venvs of their own (.ci/twinkle and .ci/llamafactory build them);
run this file there with this checkout on ``PYTHONPATH``. HF ``kernels`` is a dependency of the
transformers this venv has. Their NPU kernels run on the emulated ``torch_npu``, each named in the report.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> tuple[int, str]:
    """``patch-engine audit ...`` in a fresh process (LlamaFactory registers its kernels on first import)."""
    done = subprocess.run([sys.executable, "-m", "engine", "audit", *args], check=False, cwd=ROOT, capture_output=True,
                          text=True, timeout=900)
    return done.returncode, done.stdout


@pytest.mark.skipif(importlib.util.find_spec("llamafactory") is None, reason="LlamaFactory is not installed here")
def test_llamafactory_v1_swiglu_on_gelu_and_its_norm_scale_are_caught_on_gemma3() -> None:
    code, out = _run("gemma3_text", "--with", "llamafactory-v1", "--with", "patchset:gemma3_text")
    assert code == 1
    # the summary line names each class with its ratio to the original's own error, then the declaration
    assert re.search(r"Gemma3MLP differs \([0-9.e+]+x\): computes op: swiglu, activation: silu where "
                     r"Gemma3MLP\.forward computes op: geglu, approximate: tanh \(exactly\)", out), out
    assert re.search(r"Gemma3RMSNorm differs \([0-9.e+]+x\): computes scale: weight where "
                     r"Gemma3RMSNorm\.forward computes scale: one_plus_weight \(exactly\)", out), out
    assert "torch_npu is the emulator of its documented ops" in out
    assert "patchset gemma3_text (engine.apply) on gemma3_text (fp32): passes" in out


@pytest.mark.skipif(importlib.util.find_spec("twinkle") is None, reason="twinkle is not installed here")
def test_twinkle_default_map_on_an_emulated_npu() -> None:
    code, out = _run("qwen3", "--with", "twinkle")
    assert "twinkle 0.5.1: kernelize(model) (DEFAULT_KERNEL_CONFIG) on qwen3 (fp32): passes" in out, out
    assert "class swapped: NpuRMSNorm" in out and "npu_swiglu_forward" in out
    assert "entries name nothing in transformers" in out  # its map's classes that do not exist, reported
    assert code == 0


@pytest.mark.skipif(importlib.util.find_spec("twinkle") is None or importlib.util.find_spec("liger_kernel") is None,
                    reason="twinkle with liger-kernel importable (its liger fallbacks) is not installed here")
def test_twinkle_olmo2_in_place_norm_backward_is_named_where_a_residual_shares_its_gradient() -> None:
    """twinkle maps OLMo 2 to Liger's RMSNorm with ``in_place=True``: the post-norms inside ``residual + norm(...)``
    overwrite the residual's gradient (1.2e6x). It was 'grads differs' with no module named; now the two post-norm
    roles are, and the norms that write in place harmlessly (q_norm, k_norm, model.norm) are not."""
    code, out = _run("olmo2", "--with", "twinkle", "--json")
    assert code == 1, out
    (audit,) = json.loads(out)["audits"]
    assert re.search(r"Olmo2RMSNorm differs \([0-9.e+]+x\): its backward writes its input's gradient into its "
                     r"output's gradient in place", audit["summary"]), audit["summary"]
    # the rows' module paths (the printed table wraps a long path within its column at a 120-column width)
    blamed = {row["path"].rsplit(".", 1)[-1] for row in audit["rows"]
              if row["cls"] == "Olmo2RMSNorm" and row["result"] == "differs"}
    assert blamed == {"post_attention_layernorm", "post_feedforward_layernorm"}, audit["rows"]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("kernels") is None or importlib.util.find_spec("liger_kernel") is None,
                    reason="HF kernels and liger-kernel are not both installed here")
def test_hf_kernels_local_mapping_on_llama() -> None:
    from conftest import tiny_for

    from engine.auditing import audit

    report = audit(tiny_for("llama").train(), "hf-kernels")
    norms = [r for r in report.rows if r.cls == "LlamaRMSNorm"]
    assert norms and {r.result for r in norms} <= {"same", "passes"}, str(report)
    assert report.verdict == "passes"
