"""DeepSpeed ZeRO-3 on CPU, 2 gloo ranks: peak memory per rank of a training step, unpatched vs fused head.

A Qwen3 of the size benchmarks/flce.py uses (hidden 1024, 4 layers, vocab 151,936, fp32), built
under ``deepspeed.zero.Init`` (as ``from_pretrained`` builds a ZeRO-3 model) with the head really
partitioned (``stage3_param_persistence_threshold: 0``), one sequence of ``--seq`` tokens per rank.
Each rank runs one warm-up step (so ZeRO-3 has traced the modules and registered any parameter
read outside its module's forward), then one measured step: forward, ``engine.backward``,
``engine.step`` (SGD, so optimizer state does not blur the head's share).

Peak memory is the allocator's: ``torch.profiler.profile(profile_memory=True)`` records every CPU
allocation and free on the rank; the running sum's maximum is the peak rise over the step
(relative to what was allocated when the step started, as benchmarks/flce.py measures it). The
floor a fused head cannot go under is the gathered head itself (``[V, H]`` fp32) plus its
gradient: 2 x 594 MiB at this size; the unpatched step also holds the logits and their gradient.

Variants: ``unpatched``; ``fused`` (``engine.apply(model, "qwen3", fused_cross_entropy=True)``).

    DS_ACCELERATOR=cpu flock /tmp/heavy.lock python benchmarks/deepspeed_zero3.py \\
        --out benchmarks/results/deepspeed_zero3_cpu.json

Writes the JSON and a Markdown table next to it (same name, ``.md``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MIB = 1 << 20
WORLD = 2
HIDDEN, VOCAB = 1024, 151_936
CONFIG = {
    "hidden_size": HIDDEN, "intermediate_size": 3072, "num_hidden_layers": 4, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": VOCAB, "max_position_embeddings": 4096,
}
DS_CONFIG = {
    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
}
VARIANTS = ("unpatched", "fused")


def peak_rise(fn: Any, mark: str = "aten::embedding") -> tuple[float, float, float]:
    """``(peak rise MiB, MiB when ``mark`` first starts, seconds)`` of ``fn()`` from the allocator's events.

    The mark (the embedding lookup: the first op of the backbone's forward) shows what the root's
    forward holds before the backbone starts: a head gathered for the whole forward is there.
    """
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    seconds = time.perf_counter() - start
    raw = list(prof.profiler.kineto_results.events())
    events = sorted((e.start_ns(), e.nbytes()) for e in raw if e.name() == "[memory]")
    level = peak = 0
    for _, nbytes in events:
        level += nbytes
        peak = max(peak, level)
    first = min(e.start_ns() for e in raw if e.name() == mark)
    return peak / MIB, sum(n for t, n in events if t < first) / MIB, seconds


def run_variant(variant: str, tied: bool, seq: int, rank: int, sizes: dict[str, int]) -> dict[str, Any]:
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    import engine

    keep = HfDeepSpeedConfig(DS_CONFIG)  # noqa: F841  transformers builds the model under zero.Init while this lives
    config = AutoConfig.for_model("qwen3", **(CONFIG | sizes), tie_word_embeddings=tied)
    vocab, hidden = config.vocab_size, config.hidden_size
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert model.lm_head.weight.numel() == 0 and model.lm_head.weight.ds_numel == vocab * hidden
    model.train()
    if variant != "unpatched":
        engine.apply(model, "qwen3", device="cpu", mode="training", fused_cross_entropy=True)
    ds_engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-4),
                                         config=DS_CONFIG)
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(rank))

    def step() -> float:
        loss = ds_engine(input_ids=ids, labels=ids).loss
        ds_engine.backward(loss)
        ds_engine.step()
        return loss.item()

    warm = step()
    external = sorted(getattr(model, "_external_params", {}).keys())
    head_external = id(model.lm_head.weight) in external
    embedding_external = not tied and id(model.get_input_embeddings().weight) in external
    peak, at_backbone, seconds = peak_rise(step)
    row = {"variant": variant, "tied": tied, "seq": seq, "rank": rank, "peak_mib": round(peak, 1),
           "mib_when_backbone_starts": round(at_backbone, 1),
           "seconds": round(seconds, 2), "warmup_loss": warm, "head_registered_on_root": head_external,
           "untied_embedding_registered_on_root": embedding_external}
    if variant != "unpatched":
        engine.revert(model)
    ds_engine.destroy()
    gc.collect()
    return row


def worker(rank: int, out: str, seq: int, tieds: list[bool], variants: list[str], sizes: dict[str, int]) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD)})
    import deepspeed

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=1800))
    deepspeed.init_distributed(dist_backend="gloo")
    try:
        rows = [run_variant(v, t, seq, rank, sizes) for t in tieds for v in variants]
        Path(f"{out}/rows{rank}.json").write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    lines = [
        "## DeepSpeed ZeRO-3 step, 2 gloo ranks on CPU: peak memory per rank, unpatched vs fused head",
        "",
        (f"Qwen3 hidden {HIDDEN}, 4 layers, vocab {VOCAB:,}, fp32, one sequence of {rows[0]['seq']} tokens per rank, "
        "built under zero.Init, `stage3_param_persistence_threshold: 0`; peak rise of allocated memory over one "
        "step (forward, backward, SGD step) after a warm-up step, from the allocator (torch.profiler)."),
        "",
        ("| embeddings | variant | rank | peak rise MiB | vs unpatched | MiB held when the backbone starts "
         "| head registered on the root | s |"),
        "|---|---|---|---:|---:|---:|---|---:|",
    ]
    base = {(r["tied"], r["rank"]): r["peak_mib"] for r in rows if r["variant"] == "unpatched"}
    for r in rows:
        ratio = r["peak_mib"] / base[(r["tied"], r["rank"])]
        lines.append(f"| {'tied' if r['tied'] else 'untied'} | {r['variant']} | {r['rank']} | {r['peak_mib']:.0f} | "
                     f"{ratio:.2f}x | {r['mib_when_backbone_starts']:.0f} | {'yes' if r['head_registered_on_root'] else 'no'} "
                     f"| {r['seconds']:.1f} |")
    lines += ["", f"    {command}", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/deepspeed_zero3_cpu.json"))
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--tied", choices=["untied", "tied", "both"], default="both")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, to check the script (not a result)")
    args = parser.parse_args()
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "vocab_size": 1024, "num_hidden_layers": 2} if args.smoke else {}
    tieds = {"untied": [False], "tied": [True], "both": [False, True]}[args.tied]
    rows = []
    for tied in tieds:  # one process group per variant: freed memory of one does not stay in the next's
        for variant in args.variants:
            with tempfile.TemporaryDirectory() as out:
                mp.spawn(worker, args=(out, args.seq, [tied], [variant], sizes), nprocs=WORLD, join=True)
                rows += [row for rank in range(WORLD) for row in json.loads(Path(f"{out}/rows{rank}.json").read_text())]
            print(rows[-2:], flush=True)
    rows.sort(key=lambda r: (r["tied"], VARIANTS.index(r["variant"]), r["rank"]))
    command = "DS_ACCELERATOR=cpu flock /tmp/heavy.lock python " + " ".join(sys.argv)
    import deepspeed
    import transformers

    payload = {"command": command, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
               "transformers": transformers.__version__, "config": CONFIG, "ds_config": DS_CONFIG, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    text = markdown(rows, command)
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
