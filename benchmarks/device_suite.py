"""The suite on an accelerator, with Liger-Kernel as the peer: ``benchmarks/run.py --device cuda``.

Sections, each variant side by side in one run:

* ``train``: one training step (forward + backward) of a Qwen3 (hidden 1024, 4 layers, vocab
  151,936, tied embeddings as Qwen3-0.6B; bf16, batch 4 x 1024 tokens) as
  - ``hf eager``: transformers unpatched (sdpa attention),
  - ``liger``: Liger-Kernel's own ``apply_liger_kernel_to_qwen3(model=model)`` (rope, RMSNorm,
    SwiGLU, fused linear cross-entropy),
  - ``ours``: ``engine.apply(model, "qwen3_flce", verify=True)``: patched *and* verified
    (per-module checks and the whole model against the unpatched copy) before timing.
  Step time (median, synchronized) and peak memory (``torch.cuda.max_memory_allocated``
  above the memory before the step) and the loss. Each variant runs in a fresh child process:
  Liger patches transformers' modeling module globally (its RMSNorm/MLP classes, rope
  function), which would leak into the other variants in one process, and a fresh process
  gives each its own peak-memory baseline.
* ``moe``: the Qwen3-30B-A3B MoE layer of ``benchmarks/moe.py`` on the device (bf16): the
  eager experts loop, transformers' default (grouped_mm), ours with ``grouped_mm`` and ``liger``.

``--dry-run`` runs the same code at tiny sizes on the CPU (the CI smoke test of this harness):
variants that need CUDA (Liger's Triton kernels) are skipped with the reason. Results go to
``<out>/<device>.json`` and ``<out>/<device>.md`` (``dry-run.*`` for a dry run).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
TRAIN = {
    "full": {"config": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 4,
                        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                        "max_position_embeddings": 2048, "tie_word_embeddings": True},
             "batch": 4, "seq": 1024, "steps": 5},
    "dry": {"config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
                       "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 128,
                       "tie_word_embeddings": True},
            "batch": 2, "seq": 32, "steps": 2},
}
MOE = {"full": {"tokens": [4096, 8192], "repeat": 5, "shape": None},
       "dry": {"tokens": [32], "repeat": 1,
               "shape": {"num_experts": 8, "num_experts_per_tok": 2, "hidden_size": 64, "moe_intermediate_size": 32}}}
VARIANTS = ("hf eager", "liger", "ours")


def cuda_ready(device: str) -> str | None:
    """None if Liger can run here, else why not."""
    if device != "cuda" or not torch.cuda.is_available():
        return "liger-kernel's Triton kernels need a CUDA device"
    if importlib.util.find_spec("liger_kernel") is None:
        return 'liger-kernel is not installed (pip install "patch-engine[cuda]")'
    return None


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _peak_start(device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current resident set
    return _status_kib("VmRSS") * 1024


def _peak_rise(device: str, before: int) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    return _status_kib("VmHWM") * 1024 - before


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def train_child(variant: str, device: str, size: str) -> dict[str, Any]:
    """One variant's training steps in this (fresh) process; returns its row."""
    from engine.tiny import build_tiny_model

    spec = TRAIN[size]
    dtype = torch.bfloat16 if size == "full" else torch.float32
    model = build_tiny_model("qwen3", spec["config"], seed=0, perturb=size == "dry", attn_implementation="sdpa")
    model = model.to(device=device, dtype=dtype).train()
    row: dict[str, Any] = {"variant": variant, "dtype": str(dtype).removeprefix("torch.")}
    if variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3

        apply_liger_kernel_to_qwen3(model=model)
    elif variant == "ours":
        import engine

        start = time.perf_counter()
        report = engine.apply(model, "qwen3_flce", device=device, verify=True)
        row["apply_and_verify_s"] = time.perf_counter() - start
        row["verified"] = True  # apply(verify=True) raises VerificationFailed otherwise
        row["kernels"] = sorted({f"{d.op}:{d.kernel}" for d in report.decisions if d.action == "patch"})
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, spec["config"]["vocab_size"], (spec["batch"], spec["seq"]), generator=gen).to(device)

    def step() -> float:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return float(loss.detach())

    for _ in range(2):
        row["loss"] = step()
    model.zero_grad(set_to_none=True)
    times = []
    for _ in range(spec["steps"]):
        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    before = _peak_start(device)
    step()
    row["peak_rise_MiB"] = _peak_rise(device, before) / 2**20
    row["step_ms"] = statistics.median(times) * 1e3
    return row


def bench_train(device: str, size: str) -> list[dict[str, Any]]:
    rows = []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for variant in VARIANTS:
        why = cuda_ready(device) if variant == "liger" else None
        if why:
            rows.append({"variant": variant, "skipped": why})
            continue
        proc = subprocess.run([sys.executable, __file__, "--child", variant, "--device", device, "--size", size],
                              capture_output=True, text=True, env=env, timeout=900, check=False)
        if proc.returncode != 0:
            rows.append({"variant": variant, "failed": proc.stderr.strip().splitlines()[-1:] or ["no output"]})
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    eager = next((r for r in rows if r["variant"] == "hf eager" and "step_ms" in r), None)
    for r in rows:
        if eager and "step_ms" in r:
            r["speedup_vs_eager"] = eager["step_ms"] / r["step_ms"]
            r["memory_vs_eager"] = r["peak_rise_MiB"] / eager["peak_rise_MiB"] if eager["peak_rise_MiB"] else None
            r["loss_diff_vs_eager"] = abs(r["loss"] - eager["loss"])
    return rows


def bench_moe(device: str, size: str) -> list[dict[str, Any]]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import moe

    spec = MOE[size]
    if spec["shape"]:
        moe.SHAPE.update(spec["shape"])
    kernels = ["grouped_mm"] + (["liger"] if cuda_ready(device) is None else [])
    rows = []
    for tokens in spec["tokens"]:
        rows += moe.run_case(tokens, "bf16", kernels, spec["repeat"], device=device)
    if "liger" not in kernels:
        rows.append({"tokens": spec["tokens"][-1], "dtype": "bf16", "variant": "ours (liger)",
                     "skipped": cuda_ready(device)})
    return rows


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [f"Device: {m['device_name']}; torch {m['torch']}, transformers {m['transformers']}, "
             f"liger-kernel {m['liger_kernel']}.", ""]
    train = results.get("train", [])
    if train:
        lines += [f"Training step ({results['train_shape']}), median step time and peak memory above the resting model:",
                  "",
                  "| variant | step ms | vs eager | peak rise MiB | vs eager | loss | note |", "|---|---|---|---|---|---|---|"]
        for r in train:
            if "step_ms" not in r:
                lines.append(f"| {r['variant']} | - | - | - | - | - | {r.get('skipped') or r.get('failed')} |")
                continue
            note = "verified; " + ", ".join(r["kernels"]) if r.get("verified") else ""
            mem = f"{r['memory_vs_eager']:.2f}x" if r.get("memory_vs_eager") else "-"
            lines.append(f"| {r['variant']} | {r['step_ms']:.1f} | **{r.get('speedup_vs_eager', 1):.2f}x** | "
                         f"{r['peak_rise_MiB']:.0f} | {mem} | {r['loss']:.4f} | {note} |")
        lines.append("")
    moe_rows = results.get("moe", [])
    if moe_rows:
        shape = "tiny (dry run)" if results["dry_run"] else "Qwen3-30B-A3B: 128 experts, top-8, hidden 2048, width 768"
        lines += [f"MoE layer ({shape}), forward + backward, bf16:", "",
                  "| tokens | variant | ms | vs eager | peak MiB | note |", "|---|---|---|---|---|---|"]
        for r in moe_rows:
            if "ms" not in r:
                lines.append(f"| {r['tokens']} | {r['variant']} | - | - | - | {r['skipped']} |")
                continue
            peak = f"{r['peak_MiB']:.0f}" if r.get("peak_MiB") is not None else "-"
            lines.append(f"| {r['tokens']} | {r['variant']} | {r['ms']:.1f} | {r['speedup_vs_eager']:.2f}x | {peak} | "
                         f"grad err {r['grad_max_rel_err']:.1e} |")
    return "\n".join(lines) + "\n"


def _train_shape(size: str) -> str:
    spec = TRAIN[size]
    c = spec["config"]
    return (f"Qwen3, hidden {c['hidden_size']}, {c['num_hidden_layers']} layers, vocab {c['vocab_size']:,}, tied; "
            f"{spec['batch']} x {spec['seq']} tokens, {'bf16' if size == 'full' else 'fp32'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU; CUDA-only variants skipped")
    parser.add_argument("--only", default="train,moe")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--size", default="full", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(train_child(args.child, args.device, args.size)))
        return 0
    device, size = ("cpu", "dry") if args.dry_run else (args.device, "full")
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here; use --dry-run for the CPU smoke run", file=sys.stderr)
        return 2
    import transformers

    liger = importlib.util.find_spec("liger_kernel")
    results: dict[str, Any] = {"machine": {
        "device_name": torch.cuda.get_device_name(0) if device == "cuda" else f"CPU ({platform.processor() or 'cpu'})",
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "liger_kernel": __import__("liger_kernel").__version__ if liger and hasattr(__import__("liger_kernel"), "__version__")
        else ("installed" if liger else "not installed")},
        "dry_run": args.dry_run,
        "train_shape": _train_shape(size)}
    sections = args.only.split(",")
    if "train" in sections:
        results["train"] = bench_train(device, size)
    if "moe" in sections:
        results["moe"] = bench_moe(device, size)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "dry-run" if args.dry_run else device
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / f"{stem}.md").write_text(markdown(results))
    print(markdown(results))
    print(f"wrote {out / f'{stem}.json'} and {out / f'{stem}.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
