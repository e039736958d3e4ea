"""DeepSpeed ZeRO-3 and FSDP2 on CPU, 2 gloo ranks: peak memory per rank of a training step, unpatched vs fused head.

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

FSDP2 (``--framework fsdp2``): the same model built whole on each rank (same seed), patched, then
``fully_shard`` on each decoder layer, on ``lm_head`` where it is untied (its own unit: whole only
for its forward and its backward; a tied head shares its weight with the embedding and stays in
the root's unit), and on the model; one measured step: forward, ``backward``, SGD step.
``--fsdp2-head with-norm`` shards the untied head in one unit with the final norm instead (see
:func:`shard_untied_head`), ``with-norm-async`` also unshards that unit with ``async_op``, ``root``
leaves the head in the root's unit. ``--fsdp2-embed own`` gives ``model.model.embed_tokens`` a unit of its own
(untied only; default ``root``: the embedding in the root's unit, unsharded for the whole root forward),
``with-layer0`` one unit with the first decoder layer (the embedding's weight first).

Variants: ``unpatched``; ``fused`` (``engine.apply(model, "qwen3", fused_cross_entropy=True)``).

    DS_ACCELERATOR=cpu flock /work/wt/heavy.lock python benchmarks/deepspeed_zero3.py \\
        --framework zero3 fsdp2 --seq 1024 --out benchmarks/results/sharded_head_cpu.json
    DS_ACCELERATOR=cpu flock /work/wt/heavy.lock python benchmarks/deepspeed_zero3.py \\
        --framework zero3 fsdp2 --seq 4096 --rank1-seq 64 --append --out benchmarks/results/sharded_head_cpu.json
    DS_ACCELERATOR=cpu flock /work/wt/heavy.lock taskset -c 1 python benchmarks/deepspeed_zero3.py \\
        --framework fsdp2 zero3 --seq 1024 --tied untied --fsdp2-head own with-norm with-norm-async root \\
        --reduce-bucket-size 0 5e7 --append --out benchmarks/results/sharded_head_cpu.json
    DS_ACCELERATOR=cpu flock /work/wt/heavy.lock taskset -c 1 python benchmarks/deepspeed_zero3.py \
        --framework fsdp2 --seq 1024 --tied untied --fsdp2-head with-norm --fsdp2-embed own root with-layer0 \
        --append --out benchmarks/results/sharded_head_cpu.json

(At 4,096 tokens an unpatched rank needs about 9 GiB over its baseline; ``--rank1-seq 64`` has rank 1
run 64 tokens, so only rank 0's row is a measurement, and the two ranks fit beside other jobs.)

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
#: ``--lean``: the ZeRO-3 settings that release what is not in use (by default, at this model's size, ZeRO-3
#: keeps every gathered parameter until its next use and every gradient in its reduce bucket to the backward's end).
LEAN = {"stage3_prefetch_bucket_size": 0, "stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0,
        "reduce_bucket_size": 10**7}
VARIANTS = ("unpatched", "fused")
FRAMEWORKS = ("zero3", "zero3-lean", "fsdp2")


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
    level = peak = at = 0
    for t, nbytes in events:
        level += nbytes
        if level > peak:
            peak, at = level, t
    first = min(e.start_ns() for e in raw if e.name() == mark)
    around = [e for e in raw if e.name() != "[memory]" and e.start_ns() <= at <= e.start_ns() + e.duration_ns()]
    global PEAK_OPS  # where the peak is: the ops running at that moment, outermost first
    PEAK_OPS = [e.name() for e in sorted(around, key=lambda e: e.start_ns())][:6]
    global ALIVE_AT_PEAK
    ALIVE_AT_PEAK = alive_at_peak(prof)
    return peak / MIB, sum(n for t, n in events if t < first) / MIB, seconds


PEAK_OPS: list[str] = []
ALIVE_AT_PEAK: list[tuple[float, str]] = []


def alive_at_peak(prof: Any, floor_mib: float = 8.0) -> list[tuple[float, str]]:
    """The step's allocations of at least ``floor_mib`` still alive at its peak: ``(MiB, op chain)``, largest first.

    Why: a peak is a sum; this says which buffers make it up (the op that allocated each, with the
    two ops around it, innermost first), from the profiler's event tree (addresses of every allocation and free).
    """
    nodes = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag.name == "Allocation":
            nodes.append(node)
    nodes.sort(key=lambda n: n.start_time_ns)
    live: dict[int, tuple[int, str]] = {}
    level = best = 0
    snapshot: dict[int, tuple[int, str]] = {}
    for node in nodes:
        fields = node.extra_fields
        level += fields.alloc_size
        if fields.alloc_size > 0:
            chain, parent = [], node.parent
            while parent is not None and len(chain) < 3:
                chain.append(parent.name.replace("autograd::engine::evaluate_function: ", "bw:"))
                parent = parent.parent
            live[fields.ptr] = (fields.alloc_size, " < ".join(chain))
        else:
            live.pop(fields.ptr, None)
        if level > best:
            best, snapshot = level, dict(live)
    big = [(round(size / MIB, 1), chain) for size, chain in snapshot.values() if size >= floor_mib * MIB]
    return sorted(big, reverse=True)


def run_variant(variant: str, tied: bool, seq: int, rank: int, sizes: dict[str, int], lean: bool,
                bucket: int | None = None) -> dict[str, Any]:
    import deepspeed
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    import engine

    ds_config = {**DS_CONFIG, "zero_optimization": DS_CONFIG["zero_optimization"] | (LEAN if lean else {})
                 | ({"reduce_bucket_size": bucket} if bucket else {})}
    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841  transformers builds the model under zero.Init while this lives
    config = AutoConfig.for_model("qwen3", **(CONFIG | sizes), tie_word_embeddings=tied)
    vocab, hidden = config.vocab_size, config.hidden_size
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    assert model.lm_head.weight.numel() == 0 and model.lm_head.weight.ds_numel == vocab * hidden
    model.train()
    if variant != "unpatched":
        engine.apply(model, "qwen3", device="cpu", mode="training", fused_cross_entropy=True)
    ds_engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-4),
                                         config=ds_config)
    ids = torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(rank))

    def step() -> float:
        loss = ds_engine(input_ids=ids, labels=ids).loss
        ds_engine.backward(loss)
        ds_engine.step()
        return loss.item()

    warm = step()
    external = sorted(getattr(model, "_external_params", {}).keys())
    head_external = id(model.lm_head.weight) in external
    peak, at_backbone, seconds = peak_rise(step)
    row = {"framework": "zero3-lean" if lean else "zero3", "hidden": hidden, "variant": variant, "tied": tied, "seq": seq, "rank": rank,
           "peak_mib": round(peak, 1), "mib_when_backbone_starts": round(at_backbone, 1),
           "seconds": round(seconds, 2), "warmup_loss": warm, "head_registered_on_root": head_external, "peak_ops": PEAK_OPS,
           "alive_at_peak": ALIVE_AT_PEAK, "reduce_bucket_size": bucket}
    if variant != "unpatched":
        engine.revert(model)
    ds_engine.destroy()
    gc.collect()
    return row


#: ``--fsdp2-head``: how an untied ``lm_head`` is sharded. ``own``: its own unit (``fully_shard(model.lm_head)``);
#: ``with-norm``: one unit with the final norm, the head's weight first in the unit's parameter order
#: (``fully_shard([model.lm_head, model.model.norm])``); ``with-norm-async``: that, and the unit's unshard with
#: ``async_op`` (torch's ``_set_unshard_async_op(True)``: the all-gather's output freed right after its copy-out,
#: not kept to the root forward's end as the last unit's is); ``root``: no unit of its own (in the root's).
FSDP2_HEADS = ("own", "with-norm", "with-norm-async", "root")


#: ``--fsdp2-embed``: how an untied model's ``embed_tokens`` is sharded. ``own``: its own unit
#: (``fully_shard(model.model.embed_tokens)``, before the layers: whole only for its own forward and backward);
#: ``with-layer0``: one unit with the first decoder layer, the embedding's weight first
#: (``fully_shard([model.model.embed_tokens, model.model.layers[0]])``: the unit's last gradient is the layer's, not
#: the ``[V, H]`` one, see :func:`shard_untied_head`); ``root``: in the root's unit (whole from the root's forward
#: start to its end).
FSDP2_EMBEDS = ("root", "own", "with-layer0")


def shard_untied_head(model: Any, how: str) -> None:
    """``fully_shard`` on the untied head as ``how`` says (see :data:`FSDP2_HEADS`), before the root's.

    Why ``with-norm``: torch's ``foreach_reduce`` (2.13, 2.14) reorders gradients in a loop whose variable
    still refers to the group's *last* gradient while the reduce-scatter runs; with the head alone in its
    unit that is the head's whole ``[V, H]`` gradient, kept beside its copy in the reduce-scatter input.
    With the norm's weight after it, the loop ends on the norm's (a few KiB).
    """
    from torch.distributed.fsdp import fully_shard

    if how == "own":
        fully_shard(model.lm_head)
    elif how.startswith("with-norm"):
        fully_shard([model.lm_head, model.model.norm])  # the order of the list is the order of the parameters
        if how == "with-norm-async":
            model.lm_head._set_unshard_async_op(True)


def run_fsdp2(variant: str, tied: bool, seq: int, rank: int, sizes: dict[str, int],
              head: str = "own", embed: str = "root") -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM

    import engine

    config = AutoConfig.for_model("qwen3", **(CONFIG | sizes), tie_word_embeddings=tied)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.train()
    if variant != "unpatched":
        engine.apply(model, "qwen3", device="cpu", mode="training", fused_cross_entropy=True)
    layers = list(model.model.layers)
    if not tied and embed == "own":  # a tied embedding shares its weight with the head: stays in the root's unit
        fully_shard(model.model.embed_tokens)
    elif not tied and embed == "with-layer0":
        fully_shard([model.model.embed_tokens, layers.pop(0)])
    for layer in layers:
        fully_shard(layer)
    if not tied:  # its own unit (alone or with the norm): whole for its forward and backward only
        shard_untied_head(model, head)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    ids = torch.randint(0, config.vocab_size, (1, seq), generator=torch.Generator().manual_seed(rank))

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    warm = step()
    group = model.lm_head._get_fsdp_state()._fsdp_param_group if not tied and head != "root" else None
    order = [p._param_fqn for p in group.fsdp_params] if group else None  # the reduce-scatter's order
    peak, at_backbone, seconds = peak_rise(step)
    row = {"framework": "fsdp2", "hidden": config.hidden_size, "variant": variant, "tied": tied, "seq": seq, "rank": rank,
           "fsdp2_head": None if tied else head, "fsdp2_embed": None if tied else embed, "head_unit_params": order,
           "peak_mib": round(peak, 1), "mib_when_backbone_starts": round(at_backbone, 1),
           "seconds": round(seconds, 2), "warmup_loss": warm, "head_registered_on_root": None,
           "peak_ops": PEAK_OPS, "alive_at_peak": ALIVE_AT_PEAK}
    return row


def worker(rank: int, out: str, framework: str, seq: int, tied: bool, variant: str, sizes: dict[str, int],
           lean: bool = False, rank1_seq: int | None = None, bucket: int | None = None,
           fsdp2_head: str = "own", fsdp2_embed: str = "root") -> None:
    if rank == 1 and rank1_seq:  # a shorter sequence on rank 1 (only rank 0's row is then the measurement)
        seq = rank1_seq
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD)})
    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))  # memory does not depend on it; time does
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=1800))
    try:
        if framework == "zero3":
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")
            row = run_variant(variant, tied, seq, rank, sizes, lean, bucket)
        else:
            row = run_fsdp2(variant, tied, seq, rank, sizes, fsdp2_head, fsdp2_embed)
        Path(f"{out}/rows{rank}.json").write_text(json.dumps([row]))
    finally:
        dist.destroy_process_group()


def key(row: dict[str, Any]) -> tuple[Any, ...]:
    head = FSDP2_HEADS.index(row.get("fsdp2_head") or "own")
    embed = FSDP2_EMBEDS.index(row.get("fsdp2_embed") or "root")
    return (FRAMEWORKS.index(row["framework"]), row.get("reduce_bucket_size") or 0, head, embed, row.get("hidden", HIDDEN),
            row["seq"], row["tied"], VARIANTS.index(row["variant"]), row["rank"])


def label(row: dict[str, Any]) -> str:
    """The framework column: ZeRO-3 with a ``reduce_bucket_size`` other than its default says which, FSDP2 with an
    untied head not in its own unit says where it is."""
    bucket = row.get("reduce_bucket_size")
    head = {"with-norm": " (fully_shard([lm_head, norm]))", "root": " (lm_head in the root's unit)",
            "with-norm-async": " (fully_shard([lm_head, norm]), async unshard)"}.get(
        row.get("fsdp2_head") or "own", "")
    embed = {"own": "embed_tokens in its own unit", "with-layer0": "fully_shard([embed_tokens, layers[0]])"}.get(
        row.get("fsdp2_embed") or "root")
    if embed:
        head = (head[:-1] + ", " if head else " (") + embed + ")"
    return row["framework"] + (f" (reduce_bucket_size {bucket:.0e})".replace("e+0", "e") if bucket else "") + head


def markdown(rows: list[dict[str, Any]], commands: list[str]) -> str:
    lines = [
        "## ZeRO-3 and FSDP2 steps, 2 gloo ranks on CPU: peak memory per rank, unpatched vs fused head",
        "",
        (f"Qwen3, 4 layers, vocab {VOCAB:,}, fp32 (hidden {HIDDEN}, 16 heads, intermediate 3072; `--hidden 256`: "
         "4 heads, intermediate 768), one sequence per rank; ZeRO-3: built under "
         "zero.Init, `stage3_param_persistence_threshold: 0`; FSDP2: `fully_shard` on each layer, on `lm_head` when "
         "untied (alone, or as the framework column says, which also names a unit for an untied `embed_tokens`), "
         "and on the model. Peak rise of allocated memory over one step (forward, backward, SGD step) after "
         "a warm-up step, from the allocator (torch.profiler); ranks 0 / 1 (one number: rank 0 alone, where rank 1 "
         "ran a shorter sequence, `--rank1-seq`, so that the run fits in this machine's memory)."),
        "",
        ("| framework | hidden | tokens per rank | embeddings | variant | peak rise MiB | vs unpatched "
         "| MiB held when the backbone starts | head registered on the root | s |"),
        "|---|---:|---:|---|---|---:|---:|---:|---|---:|",
    ]
    base = {(label(r), r.get("hidden", HIDDEN), r["seq"], r["tied"], r["rank"]): r["peak_mib"]
            for r in rows if r["variant"] == "unpatched"}
    pairs: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in sorted(rows, key=key):
        pairs.setdefault(key(r)[:-1], []).append(r)
    for group in pairs.values():
        r = group[0]
        ids = [(label(g), g.get("hidden", HIDDEN), g["seq"], g["tied"], g["rank"]) for g in group]
        ratios = [g["peak_mib"] / base[i] if i in base else float("nan") for g, i in zip(group, ids)]
        registered = {None: "-", True: "yes", False: "no"}[r["head_registered_on_root"]]
        lines.append(
            f"| {label(r)} | {r.get('hidden', HIDDEN)} | {r['seq']} | {'tied' if r['tied'] else 'untied'} | {r['variant']} | "
            + " / ".join(f"{g['peak_mib']:.0f}" for g in group) + " | "
            + " / ".join(f"{x:.2f}x" if x == x else "-" for x in ratios) + " | "
            + " / ".join(f"{g['mib_when_backbone_starts']:.0f}" for g in group)
            + f" | {registered} | {max(g['seconds'] for g in group):.1f} |")
    lines += ["", ("At each peak (rank 0): the ops running, and the step's buffers of 64 MiB or more then alive "
                   "(MiB, the op that allocated each):"), ""]
    for r in sorted(rows, key=key):
        if r["rank"] == 0 and r.get("alive_at_peak") is not None:
            alive = "; ".join(f"{mib:.0f} {chain.split(' < ')[0]}" + (f" ({chain.split(' < ')[-1]})" if " < " in chain else "")
                              for mib, chain in r["alive_at_peak"] if mib >= 64)
            lines.append(f"- {label(r)} {r['seq']} {'tied' if r['tied'] else 'untied'} {r['variant']}: "
                         f"at {' > '.join(r['peak_ops'][:3])}; alive: {alive}")
    lines += ["", "Commands (each adds its rows to the file):", ""] + [f"    {c}" for c in commands] + [""]
    return "\n".join(lines)


def write(out: Path, rows: list[dict[str, Any]], commands: list[str]) -> str:
    import deepspeed
    import transformers

    payload = {"commands": commands, "torch": torch.__version__, "deepspeed": deepspeed.__version__,
               "transformers": transformers.__version__, "config": CONFIG, "ds_config": DS_CONFIG,
               "rows": sorted(rows, key=key)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1) + "\n")
    text = markdown(rows, commands)
    out.with_suffix(".md").write_text(text)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/sharded_head_cpu.json"))
    parser.add_argument("--framework", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    parser.add_argument("--seq", type=int, nargs="+", default=[1024])
    parser.add_argument("--tied", choices=["untied", "tied", "both"], default="both")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--hidden", type=int, choices=[HIDDEN, 256], default=HIDDEN,
                        help="256: the same vocab with a quarter of the width (a proxy that fits beside other jobs)")
    parser.add_argument("--rank1-seq", type=int, default=None,
                        help="rank 1 runs this many tokens instead (its row is dropped): rank 0's peak at --seq "
                             "where two full-length ranks do not fit in this machine's memory")
    parser.add_argument("--append", action="store_true", help="keep the file's other rows (replacing the ones rerun)")
    parser.add_argument("--reduce-bucket-size", type=float, nargs="+", default=[0],
                        help="ZeRO-3's reduce_bucket_size in elements, one run each (0: DeepSpeed's default, 5e8); e.g. "
                             "5e7, below the head's [V, H] so its gradient is not copied into one bucket with all the others")
    parser.add_argument("--fsdp2-head", choices=FSDP2_HEADS, nargs="+", default=["own"],
                        help="FSDP2, untied: own = fully_shard(model.lm_head); with-norm = fully_shard([model.lm_head, "
                             "model.model.norm]) (the head's gradient not the last of its unit); with-norm-async = that and "
                             "lm_head._set_unshard_async_op(True); root = no unit of its own")
    parser.add_argument("--fsdp2-embed", choices=FSDP2_EMBEDS, nargs="+", default=["root"],
                        help="FSDP2, untied: root = embed_tokens in the root's unit (unsharded for the whole root "
                             "forward); own = fully_shard(model.model.embed_tokens) before the layers; with-layer0 = "
                             "fully_shard([model.model.embed_tokens, model.model.layers[0]]) (its gradient not its unit's last)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model, to check the script (not a result)")
    args = parser.parse_args()
    sizes = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "vocab_size": 1024, "num_hidden_layers": 2} if args.smoke else {}
    if args.hidden == 256 and not args.smoke:
        sizes = {"hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4, "num_key_value_heads": 2}
    tieds = {"untied": [False], "tied": [True], "both": [False, True]}[args.tied]
    command = "DS_ACCELERATOR=cpu flock /work/wt/heavy.lock python " + " ".join(sys.argv)
    rows: list[dict[str, Any]] = []
    commands = [command]
    if args.append and args.out.exists():
        old = json.loads(args.out.read_text())
        rows, commands = old["rows"], [*old.get("commands", [old.get("command")]), command]
    text = ""
    runs = [(framework, seq, tied, setting, variant) for framework in args.framework for seq in args.seq
            for tied in tieds
            for setting in ([int(b) or None for b in args.reduce_bucket_size] if framework.startswith("zero3")
                            else [(h, e) for h in args.fsdp2_head for e in args.fsdp2_embed] if not tied
                            else [("own", "root")])
            for variant in args.variants]
    for framework, seq, tied, setting, variant in runs:  # one process group per run: freed memory stays in none
        with tempfile.TemporaryDirectory() as out:
            args_ = (out, framework.removesuffix("-lean"), seq, tied, variant, sizes,
                     framework.endswith("-lean"), args.rank1_seq,
                     setting if framework.startswith("zero3") else None,
                     *(setting if framework == "fsdp2" else ("own", "root")))
            mp.spawn(worker, args=args_, nprocs=WORLD, join=True)
            ranks = [0] if args.rank1_seq else range(WORLD)  # rank 1 then ran another length
            new = [row | {"rank1_seq": args.rank1_seq} for rank in ranks
                   for row in json.loads(Path(f"{out}/rows{rank}.json").read_text())]
        rows = [r for r in rows if key(r) not in {key(n) for n in new}] + new
        print(new, flush=True)
        text = write(args.out, rows, commands)  # after every run: a partial table survives
    print(text)


if __name__ == "__main__":
    main()
