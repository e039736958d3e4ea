"""One Qwen3-30B-A3B-shaped MoE layer on CPU: eager vs transformers' default vs this engine, side by side.

The layer is transformers' own ``Qwen3MoeSparseMoeBlock`` (router + ``Qwen3MoeExperts``) with
128 experts, top-8, hidden 2048, expert width 768, in one process with one set of weights:

* ``eager``: ``config._experts_implementation = "eager"`` (the per-expert loop);
* ``hf default``: what ``from_pretrained`` picks, ``grouped_mm`` where torch has it;
* ``ours <kernel>``: the experts module patched by the engine's ``moe_experts`` op with each
  registered provider that runs here (``grouped_mm``; ``compiled``, the grouped path through
  inductor in bf16 and uncompiled in fp32; ``torch`` is the eager loop again).

Each measurement is forward + backward (loss = sum(out * g) for a fixed random g, so every
expert weight and the router get gradients), interleaved round-robin, median of ``--repeat``.
The output and the gradients of every variant are checked against eager's (max abs error).

    python benchmarks/moe.py --tokens 512 2048 --dtype bf16 fp32 --eager-dtypes bf16 --kernels grouped_mm compiled \
        --json benchmarks/results/moe_cpu.json --section benchmarks/results/cpu.md
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.commands import results_sections

SHAPE = {"num_experts": 128, "num_experts_per_tok": 8, "hidden_size": 2048, "moe_intermediate_size": 768}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_block(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """A Qwen3-30B-A3B MoE block with random weights (std 0.02, as the model's init)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(**SHAPE, norm_topk_prob=True)
    config._experts_implementation = "grouped_mm"
    torch.manual_seed(seed)
    block = Qwen3MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.02)
    return block.to(dtype)


def patched_forward(block: torch.nn.Module, kernel: str) -> Callable[..., torch.Tensor]:
    """The forward the engine's ``moe_experts`` op binds to ``block.experts`` with the named provider."""
    from types import MethodType

    from engine.kernels import registry
    from engine.ops.base import get_op
    from engine.schema import MoeExpertsPatch

    op = get_op("moe_experts")
    patch = MoeExpertsPatch(target=type(block.experts).__name__, op="moe_experts", kernel=kernel)
    op.check_target(block.experts, patch)
    impl = registry.get(kernel, "moe_experts").build(patch)
    return MethodType(op.bind(block.experts, patch, impl), block.experts)


def set_variant(block: torch.nn.Module, implementation: str, forward: Callable[..., Any] | None) -> None:
    """One block, one set of weights: a variant is transformers' implementation or a patched forward."""
    block.experts.config._experts_implementation = implementation
    if forward is None:
        block.experts.__dict__.pop("forward", None)
    else:
        block.experts.forward = forward


def step(block: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    block.zero_grad(set_to_none=True)
    out = block(x)
    (out.float() * g).sum().backward()
    grads = {n: p.grad for n, p in block.named_parameters() if p.grad is not None}
    block.zero_grad(set_to_none=True)
    return out.detach(), grads


def run_case(tokens: int, dtype_name: str, kernels: list[str], repeat: int, eager: bool = True,
             device: str = "cpu") -> list[dict[str, Any]]:
    dtype = DTYPES[dtype_name]
    block = build_block(dtype).to(device)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, tokens, SHAPE["hidden_size"], generator=gen).to(device=device, dtype=dtype)
    g = torch.randn(1, tokens, SHAPE["hidden_size"], generator=gen).to(device)
    cuda = device == "cuda"
    peaks: dict[str, float] = {}
    variants: dict[str, tuple[str, Callable[..., Any] | None]] = {"eager": ("eager", None)} if eager else {}
    variants["hf default (grouped_mm)"] = ("grouped_mm", None)
    for kernel in kernels:
        variants[f"ours ({kernel})"] = ("eager", patched_forward(block, kernel))

    def run(name: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        set_variant(block, *variants[name])
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        result = step(block, x, g)
        if cuda:
            torch.cuda.synchronize()
            peaks[name] = (torch.cuda.max_memory_allocated() - before) / 2**20
        return result

    # Errors against the eager loop (against transformers' default where eager is skipped).
    ref_name = next(iter(variants))
    start = time.perf_counter()
    ref_out, ref_grads = run(ref_name)
    first = time.perf_counter() - start
    errors = {ref_name: (0.0, 0.0)}
    for name in list(variants)[1:]:
        out, grads = run(name)
        worst = max(float((grads[n].float() - ref_grads[n].float()).abs().max()
                          / ref_grads[n].float().abs().max().clamp_min(1e-30)) for n in ref_grads)
        errors[name] = (float((out.float() - ref_out.float()).abs().max()), worst)
        del out, grads
    del ref_out, ref_grads
    gc.collect()

    times: dict[str, list[float]] = {name: [] for name in variants}
    slow = eager and first > 20.0  # the eager loop at this size: its first run counts as one sample
    if slow:
        times["eager"].append(first)
    for i in range(repeat):
        for name in variants:
            if slow and name == "eager" and i >= repeat - 1:
                continue
            start = time.perf_counter()
            run(name)
            times[name].append(time.perf_counter() - start)
    eager_ms = statistics.median(times["eager"]) * 1e3 if eager else None
    rows = []
    for name in variants:
        ms = statistics.median(times[name]) * 1e3
        rows.append({"tokens": tokens, "dtype": dtype_name, "variant": name, "ms": round(ms, 1), "runs": len(times[name]),
                     "speedup_vs_eager": round(eager_ms / ms, 2) if eager_ms else None,
                     "out_max_abs_err": errors[name][0], "grad_max_rel_err": errors[name][1],
                     "errors_vs": ref_name, "peak_MiB": peaks.get(name)})
    return rows


def markdown(rows: list[dict[str, Any]], threads: int) -> str:
    lines = [
        f"MoE layer (Qwen3-30B-A3B shape: 128 experts, top-8, hidden 2048, expert width 768), forward + backward, "
        f"CPU, {threads} threads, median; errors (output max abs; worst gradient max abs / max |grad|) vs the variant named last.",
        "",
        "| tokens | dtype | variant | ms | vs eager | vs hf default | out err | grad err | errors vs |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        default = next(x for x in rows if x["tokens"] == r["tokens"] and x["dtype"] == r["dtype"]
                       and x["variant"].startswith("hf default"))
        vs_default = default["ms"] / r["ms"]
        vs_eager = f"**{r['speedup_vs_eager']:.2f}x**" if r["speedup_vs_eager"] else "not run"
        lines.append(f"| {r['tokens']} | {r['dtype']} | {r['variant']} | {r['ms']:.0f} | {vs_eager} | "
                     f"**{vs_default:.2f}x** | {r['out_max_abs_err']:.1e} | {r['grad_max_rel_err']:.1e} | "
                     f"{r['errors_vs']} |")
    return "\n".join(lines) + "\n"


SECTION = "moe"  # written by benchmarks/moe.py


def write_section(path: Path, text: str, title: str = "### MoE experts") -> None:
    """Put ``text`` into ``path`` between this script's markers: other writers' sections stay as they are."""
    results_sections.write_section(path, f"{title}\n\n{text.rstrip()}", SECTION)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--dtype", nargs="+", default=["bf16", "fp32"], choices=sorted(DTYPES))
    parser.add_argument("--kernels", nargs="+", default=["grouped_mm"])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--eager-dtypes", nargs="*", default=["bf16", "fp32"], choices=sorted(DTYPES),
                        help="dtypes to run the eager loop in (fp32 eager needs ~2x bf16's ~9 GiB)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--section", type=Path, help="also write the table as the MoE section of this file "
                        "(e.g. benchmarks/results/cpu.md), between markers, leaving its other sections alone")
    args = parser.parse_args(argv)
    rows = []
    for dtype_name in args.dtype:
        for tokens in args.tokens:
            case = run_case(tokens, dtype_name, args.kernels, args.repeat, eager=dtype_name in args.eager_dtypes)
            rows.extend(case)
            print(json.dumps(case), flush=True)
    text = markdown(rows, torch.get_num_threads())
    print(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(text)
    if args.section:
        write_section(args.section, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
