"""Fused linear cross-entropy on CPU: peak memory (from the allocator) and time, side by side in one run.

Two tables (issue 13):

1. **Training step** of a Qwen3 (hidden 1024, 4 layers, vocab 151,936, seq 1024, fp32),
   tied and untied embeddings, unpatched vs ``engine.apply(model, "qwen3", fused_cross_entropy=True)``:
   forward + backward from ``zero_grad(set_to_none=True)``; the peak rise of allocated
   memory during the step, and the gradient floor (the parameter gradients, which must exist
   at the end of any step).
2. **Kernel alone**, hidden 1024, vocab 151,936, N = 1024 and 4096 tokens, fp32 and bf16:
   plain ``F.cross_entropy(F.linear(h, W).float(), t)``, ours (``chunked_linear_cross_entropy``)
   and apple's ``cut-cross-entropy`` 25.1.1 (its ``torch_compile`` implementation, the one
   that runs on CPU): loss and gradients against the fp32 truth, peak memory rise (incl. the
   h / W gradients the step produces), time.

Peak memory is measured with the allocator: ``torch.profiler.profile(profile_memory=True)``
records every CPU allocation and free; the running sum's maximum is the peak rise over the
step. Times are single runs without the profiler (the machine is shared; compare within a row).

    flock /tmp/heavy.lock python benchmarks/flce.py --out benchmarks/results/flce_cpu.json

Writes the JSON and prints the Markdown tables (pasted into ``benchmarks/results/cpu.md``).
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
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import engine
from engine.commands import results_sections
from engine.ops.flce_torch import chunked_linear_cross_entropy

MIB = 1 << 20
HIDDEN, VOCAB = 1024, 151_936
TRAIN_CONFIG = {
    "hidden_size": HIDDEN, "intermediate_size": 3072, "num_hidden_layers": 4, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": VOCAB, "max_position_embeddings": 2048,
}


def measure(fn: Callable[[], Any], mark: str | None = None) -> tuple[Any, float, float, float | None]:
    """``(result, peak rise MiB, seconds, MiB at mark)``: ``fn`` timed on its own, then run again under the profiler.

    The peak is the maximum of the allocator's running total over the second run: the
    profiler records every CPU allocation and free with its size. Its own overhead (it
    multiplies the time of small ops) is why the time comes from the first run. With
    ``mark`` (an op's name), the fourth value is the running total (MiB) when that op first
    starts; without, ``None``.
    """
    gc.collect()
    start = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - start
    del result
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    raw = list(prof.profiler.kineto_results.events())  # every allocation and free, with its size (the allocator's)
    events = sorted((e.start_ns(), e.nbytes()) for e in raw if e.name() == "[memory]")
    level = peak = 0
    for _, nbytes in events:
        level += nbytes
        peak = max(peak, level)
    if mark is None:
        return result, peak / MIB, seconds, None
    start = min(e.start_ns() for e in raw if e.name() == mark)
    return result, peak / MIB, seconds, sum(n for t, n in events if t < start) / MIB


# -- training step ------------------------------------------------------------------------------


def _train_model(tied: bool, fused: bool) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("qwen3", tie_word_embeddings=tied, **TRAIN_CONFIG)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg).train()
    if fused:
        engine.apply(model, "qwen3", device="cpu", mode="training", fused_cross_entropy=True)
    return model


def bench_train(seq: int = 1024) -> list[dict[str, Any]]:
    """Unpatched and fused steps, tied and untied, with the step's memory floor.

    The floor is the most that must exist at one time in any step:

    * at the end, every parameter gradient (the ``gradient floor``);
    * when the head's gradient is formed, the activations the backbone saved for backward
      plus the head's ``[V, H]`` gradient (unfused: the first op of backward; fused: the
      forward, where the kernel computes it). The activations are the allocator's total when
      the fused kernel starts (the backbone's forward, with no logits).

    With tied embeddings the second is the larger (the weight's one gradient is shared).
    """
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(0))
    rows = []
    for tied in (False, True):
        for fused in (True, False):  # fused first: it measures the activations the floor counts
            model = _train_model(tied, fused)

            def step(model: torch.nn.Module = model) -> float:
                out = model(input_ids=ids, labels=ids)
                out.loss.backward()  # the peak is here: parameter gradients + what backward holds
                loss = out.loss.item()
                del out
                model.zero_grad(set_to_none=True)  # the next run starts from the same state
                return loss

            step()  # warm-up (allocator, lazy init)
            loss, peak, seconds, at_head = measure(step, mark="_ChunkedLinearCrossEntropy" if fused else None)
            if fused:  # the model's unpatched step (next) divides by the same floor
                activations = at_head
            grads = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad) / MIB
            head = model.lm_head.weight
            floor = max(grads, activations + head.numel() * head.element_size() / MIB)
            rows.append({"embeddings": "tied" if tied else "untied", "variant": "fused" if fused else "unpatched",
                         "loss": loss, "peak_rise_MiB": peak, "grad_floor_MiB": grads, "activations_MiB": activations,
                         "floor_MiB": floor, "seconds": seconds})
            print(json.dumps(rows[-1]), flush=True)
            del model
            gc.collect()
    return rows


# -- kernel alone -------------------------------------------------------------------------------


def _plain(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float(), t)


def _ours(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return chunked_linear_cross_entropy(h, w, t)


def _cce() -> Callable[..., torch.Tensor] | None:
    try:
        from cut_cross_entropy import linear_cross_entropy
    except ImportError:
        return None
    return lambda h, w, t: linear_cross_entropy(h, w, t, impl="torch_compile")


def _inputs(n: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    h = (torch.randn(n, HIDDEN, generator=gen)).to(dtype)
    w = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02).to(dtype)
    t = torch.randint(0, VOCAB, (n,), generator=gen)
    t[: n // 8] = -100  # prompt tokens
    return h, w, t


def _run(fn: Callable[..., torch.Tensor], h: torch.Tensor, w: torch.Tensor, t: torch.Tensor):
    hh, ww = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = fn(hh, ww, t)
    loss.backward()
    return loss.detach().float(), hh.grad, ww.grad


def _rel_err(got: torch.Tensor, truth: torch.Tensor) -> float:
    return float((got.float() - truth).abs().max() / truth.abs().max())


def bench_kernels(sizes: tuple[int, ...] = (1024, 4096), repeat: int = 3) -> list[dict[str, Any]]:
    """Each (N, dtype): the methods' times interleaved round-robin (median of ``repeat``), then each one's peak.

    Why interleaved: on a shared machine the speed drifts over minutes; running the methods
    in turn, several times, puts that drift in every column instead of one. ``plain`` (not
    the peer) is timed once.
    """
    methods: dict[str, Callable[..., torch.Tensor]] = {"plain": _plain, "ours": _ours}
    cce = _cce()
    if cce is not None:
        methods["cut-cross-entropy"] = cce
    rows = []
    for n in sizes:
        h, w, t = _inputs(n, torch.float32)
        for dtype in (torch.float32, torch.bfloat16):
            hd, wd = h.to(dtype), w.to(dtype)
            # The fp32 truth of these (rounded) inputs: all logits, every step in fp32.
            truth = _run(_plain, hd.float(), wd.float(), t)
            if "cut-cross-entropy" in methods:
                _run(methods["cut-cross-entropy"], hd[:64], wd, t[:64])  # torch.compile: outside the measurement
            times: dict[str, list[float]] = {name: [] for name in methods}
            for i in range(repeat):
                for name, fn in methods.items():
                    if name == "plain" and i:
                        continue
                    gc.collect()
                    begin = time.perf_counter()
                    _run(fn, hd, wd, t)
                    times[name].append(time.perf_counter() - begin)
            for name, fn in methods.items():
                (loss, gh, gw), peak, _, _ = measure(lambda fn=fn, hd=hd, wd=wd, t=t: _run(fn, hd, wd, t))
                row = {
                    "N": n, "dtype": str(dtype).removeprefix("torch."), "method": name, "peak_rise_MiB": peak,
                    "seconds": statistics.median(times[name]), "times": times[name], "loss": float(loss),
                    "loss_err": abs(float(loss) - float(truth[0])),
                    "grad_h_rel_err": _rel_err(gh, truth[1]), "grad_w_rel_err": _rel_err(gw, truth[2]),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
                del loss, gh, gw
                gc.collect()
            del hd, wd, truth
        del h, w
        gc.collect()
    return rows


# -- output -------------------------------------------------------------------------------------


def markdown(results: dict[str, Any]) -> str:
    out = []
    if results.get("train"):
        out += [("| embeddings | variant | peak rise MiB | parameter gradients MiB | activations at the head MiB | "
                 "floor MiB | peak / floor | step s | loss |"), "|---|---|---|---|---|---|---|---|---|"]
        for r in results["train"]:
            out.append(f"| {r['embeddings']} | {r['variant']} | {r['peak_rise_MiB']:.0f} | {r['grad_floor_MiB']:.0f} | "
                       f"{r['activations_MiB']:.0f} | {r['floor_MiB']:.0f} | {r['peak_rise_MiB'] / r['floor_MiB']:.2f} | "
                       f"{r['seconds']:.2f} | {r['loss']:.6f} |")
        out.append("")
    if results.get("kernels"):
        by_key: dict[tuple[int, str], dict[str, dict[str, Any]]] = {}
        for r in results["kernels"]:
            by_key.setdefault((r["N"], r["dtype"]), {})[r["method"]] = r
        names = list(next(iter(by_key.values())))
        out.append("| N, dtype | " + " | ".join(f"{m} MiB / s" for m in names) + " | ours vs peer: memory, time |")
        out.append("|---|" + "---|" * len(names) + "---|")
        for (n, dtype), row in by_key.items():
            cells = [f"{row[m]['peak_rise_MiB']:.0f} / {row[m]['seconds']:.2f}" for m in names]
            peer = row.get("cut-cross-entropy")
            ratio = (f"{row['ours']['peak_rise_MiB'] / peer['peak_rise_MiB']:.2f}x, "
                     f"{row['ours']['seconds'] / peer['seconds']:.2f}x") if peer else "-"
            out.append(f"| {n} {dtype} | " + " | ".join(cells) + f" | {ratio} |")
        out += ["", "| N, dtype | method | loss | loss err vs fp32 | grad_h max rel err | grad_W max rel err |",
                "|---|---|---|---|---|---|"]
        for r in results["kernels"]:
            out.append(f"| {r['N']} {r['dtype']} | {r['method']} | {r['loss']:.6f} | {r['loss_err']:.1e} | "
                       f"{r['grad_h_rel_err']:.1e} | {r['grad_w_rel_err']:.1e} |")
    return "\n".join(out)


SECTION = "fused-linear-cross-entropy"


def write_section(path: Path, text: str, name: str = SECTION) -> None:
    """Put ``text`` in ``path`` between this section's markers, leaving every other section as it is."""
    results_sections.write_section(path, text, name)


def section_text(results: dict[str, Any]) -> str:
    return (
        "## Fused linear cross-entropy\n\n"
        "Written by `flock /tmp/heavy.lock python benchmarks/flce.py` (peak = the allocator's running total under "
        "`torch.profiler(profile_memory=True)`, rise over the step; kernel times: the median of "
        f"{results.get('repeat', 3)} interleaved runs without the profiler (training steps: one run); torch {results.get('torch')}, {results.get('threads')} threads; the machine is shared).\n\n"
        + markdown(results) + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", nargs="+", default=["train", "kernels"], choices=["train", "kernels"])
    parser.add_argument("--sizes", nargs="+", type=int, default=[1024, 4096])
    parser.add_argument("--repeat", type=int, default=3, help="timed runs per method (interleaved; median)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/flce_cpu.json"))
    parser.add_argument("--md", type=Path, default=Path("benchmarks/results/cpu.md"),
                        help="Markdown file whose fused-linear-cross-entropy section is (re)written")
    parser.add_argument("--render", action="store_true", help="only render --out into --md, measure nothing")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads(), "repeat": args.repeat}
    if args.render:
        results = json.loads(args.out.read_text())
        write_section(args.md, section_text(results))
        print(markdown(results))
        return 0
    if "train" in args.sections:
        results["train"] = bench_train()
    if "kernels" in args.sections:
        results["kernels"] = bench_kernels(tuple(args.sizes), args.repeat)
    if args.out.exists():  # keep the other section of a previous run
        previous = json.loads(args.out.read_text())
        results = {**previous, **results}
    args.out.write_text(json.dumps(results, indent=1))
    write_section(args.md, section_text(results))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
