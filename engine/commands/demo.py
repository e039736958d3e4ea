"""``patch-engine demo``: the main job, end to end, on whatever device this is. No downloads.

Builds a small Qwen3 from a config, perturbs its weights (norm weights away from 1),
applies the patchset to one copy and verifies it (every patched module and the whole model
against the original and its fp64 truth: ``engine.apply(..., verify=True)``), and prints the
report, the verdict, the largest difference of the logits and the loss against the unpatched
copy, and the time of a forward+backward of each.
"""

from __future__ import annotations

import copy
import time

import torch

from engine.api import apply
from engine.runtime.devices import current_device
from engine.tiny import build_tiny_model
from engine.verification import compare

__all__ = ["DEMO_CONFIG", "ratio_note", "run_demo"]

DEMO_CONFIG = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "vocab_size": 2048,
}


def _time_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], steps: int) -> float:
    times = []
    for _ in range(steps + 1):  # the first run warms up
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        model(**batch).loss.backward()
        if batch["input_ids"].device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def run_demo(patchset: str = "qwen3", *, steps: int = 3) -> int:
    device = current_device()
    torch_device = "cpu" if device.value in ("cpu",) else device.value
    print(f"device: {device.value}, torch {torch.__version__}")
    reference = build_tiny_model("qwen3", DEMO_CONFIG, seed=0).to(torch_device)
    patched = copy.deepcopy(reference)
    report = apply(patched, patchset, device=device, verify=True)
    print(report)
    print(report.verification.headline())  # the per-module table is patch-engine verify's
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, DEMO_CONFIG["vocab_size"], (4, 128), generator=gen).to(torch_device)
    batch = {"input_ids": ids, "labels": ids}
    with torch.no_grad():
        ref_out, pat_out = reference(**batch), patched(**batch)
    logits_err = compare(pat_out.logits, ref_out.logits)[0]
    loss_err = abs(float(pat_out.loss) - float(ref_out.loss))
    print(f"\nlogits max |diff|: {logits_err:.3e}    loss: {float(ref_out.loss):.6f} unpatched, "
          f"{float(pat_out.loss):.6f} patched (|diff| {loss_err:.3e})")
    t_ref = _time_step(reference, batch, steps)
    t_pat = _time_step(patched, batch, steps)
    print(f"forward+backward (median of {steps}): unpatched {t_ref * 1e3:.1f} ms, patched {t_pat * 1e3:.1f} ms "
          f"(ratio {t_ref / t_pat:.2f}x)")
    print(ratio_note(device.value))
    ok = logits_err <= 1e-4 and loss_err <= 1e-5
    print("numbers match" if ok else "NUMBERS DIFFER")
    return 0 if ok else 1


def ratio_note(device: str) -> str:
    """What the demo's timing ratio means on this device: a CPU's ratio is not a kernel's speed-up."""
    meaning = "ratio = unpatched time / patched time: above 1x the patched step is faster"
    if device == "cpu":
        return (f"{meaning}. On a CPU the patched model runs each op's torch reference (the fused kernels are for "
                "CUDA and NPU; the compiled one only where it measured faster), so the ratio is this machine's "
                "run-to-run noise and the engine's per-call cost, not a kernel's speed-up (on an idle CPU, about 1x); "
                "measured speed-ups: docs/performance.md")
    return f"{meaning} (one small model, {device}, a few steps; benchmarks measured side by side: docs/performance.md)"
