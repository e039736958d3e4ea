"""A model built and patched inside ``with torch.device("meta")``, the engine's first use in the process.

Why: the gated-MLP activation probe was made when ``engine.ops.gated_mlp`` was imported, on the
default device; imported first inside a meta-device block (a model built on meta and patched
there, as FSDP2's meta init does, or inside transformers' ``from_pretrained``), it was a meta
tensor, and from then on every swiglu/geglu check in the process refused its MLP ("SiLUActivation,
which does not compute silu exactly"); the experts' check made its probe the same way, on meta,
and raised torch's ``Tensor.item() cannot be called on meta tensors``. Found by running
transformers' own tests on patched models (tests/hf_suite/): 0 of 715 qwen3 models patched.
A subprocess: the probe is made at import, which in this test process happened long ago.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import torch
from transformers import AutoConfig, AutoModelForCausalLM
import engine

def tiny(model_type, **extra):
    config = AutoConfig.for_model(model_type, vocab_size=64, hidden_size=32, intermediate_size=48,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, **extra)
    return AutoModelForCausalLM.from_config(config)

def ops(model, name):
    return sorted({d.op for d in engine.apply(model, name).decisions if d.action == "patch"})

with torch.device("meta"):  # the engine's first use: its modules are imported here
    print(ops(tiny("qwen3"), "qwen3"))
    print(ops(tiny("qwen3_moe", moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2), "qwen3_moe"))
print(ops(tiny("qwen3"), "qwen3"))  # and afterwards, on the CPU
"""


def test_first_apply_inside_a_meta_device_block_patches_mlps_and_experts() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:3] == ["['rms_norm', 'rope', 'swiglu']", "['moe_experts', 'rms_norm', 'rope']",
                                           "['rms_norm', 'rope', 'swiglu']"]
