"""The fp64 truth's peak memory per decoder layer at Qwen3-8B's width: the slope that scales verify to 36 layers.

Why: ``benchmarks/verify_memory.py`` measures verify on a ~1B Qwen3 (Qwen3-8B's width, 2 layers,
151,936-token tied head), where the head dominates; extrapolating to Qwen3-8B's 36 layers needs
what one more layer adds to the truth's peak. This runs only the truth (``models._truth_run``:
the original in fp64, its gradients sent to a sink) on Qwen3-8B-width models with a 256-token
vocabulary (no head cost) and ``L`` layers, in bf16, on the same 2 x 160 random ids, and prints
the allocator's peak rise (``torch.profiler(profile_memory=True)``) per ``L``; the slope is the
per-layer cost. One profiled run per ``L`` (no timed run: nothing is compiled).

    PYTHONPATH=. flock /work/wt/heavy.lock python benchmarks/verify_truth_layers.py 1 2
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from verify_memory import MIB, QWEN3_1B, TOKENS

from engine.verification import models, verdicts


def truth_peak(layers: int) -> float:
    """Peak rise (MiB) of the fp64 truth's forward and backward on a ``layers``-layer, 256-token-vocab Qwen3."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(**{**QWEN3_1B, "num_hidden_layers": layers, "vocab_size": 256})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()
    ids = torch.randint(0, 256, (2, TOKENS), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        models._truth_run(model, batch, "logits", verdicts.Grads(), torch.device("cpu"), lambda truth: None)
    level = peak = 0
    for _, n in sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                       if e.name() == "[memory]"):
        level += n
        peak = max(peak, level)
    return peak / MIB


if __name__ == "__main__":
    for n in map(int, sys.argv[1:] or ["1", "2"]):
        print(f"layers {n}: truth peak rise {truth_peak(n):.0f} MiB (2 x {TOKENS} tokens)", flush=True)
