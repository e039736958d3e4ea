"""The per-rank body of the FSDP2 test (imported by spawned processes, so not a test module).

Each rank trains the same tiny Qwen3 (same seed) on its own batches, first unpatched and then
patched (``engine.apply`` before ``fully_shard``), for three AdamW steps; then saves the
patched model with torch.distributed.checkpoint and loads it into a fresh unpatched model.
Results go to ``<dir>/rank<r>.pt`` for the parent to compare.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

STEPS = 3
LR = 1e-3
WORLD = 2


def batches_for(rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, 256, (2, 16), generator=gen) for _ in range(STEPS)]


def build(*, patched: bool, seed: int = 0) -> torch.nn.Module:
    from conftest import tiny_for
    from training_helpers import qwen3_patchset

    import engine

    model = tiny_for("qwen3", seed=seed)
    if patched:
        engine.apply(model, qwen3_patchset(), device="cpu", mode="training")  # before fully_shard
    return model


def shard(model: torch.nn.Module) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def train(model: torch.nn.Module, batches: list[torch.Tensor]) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def worker(rank: int, out: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    from torch.distributed.tensor import DTensor

    import engine

    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        batches = batches_for(rank)
        unpatched = train(shard(build(patched=False)), batches)
        model = shard(build(patched=True))
        norm = model.model.layers[0].input_layernorm
        weight_is_dtensor = isinstance(norm.weight, DTensor)
        still_patched = engine.is_patched(model) and "forward" in norm.__dict__
        patched = train(model, batches)

        dcp.save(get_model_state_dict(model), checkpoint_id=f"{out}/ckpt")
        fresh = shard(build(patched=False, seed=1))  # other weights, so a load that did nothing shows
        probe = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            expected = model(input_ids=probe).logits
            before = fresh(input_ids=probe).logits
            state = get_model_state_dict(fresh)
            dcp.load(state, checkpoint_id=f"{out}/ckpt")
            set_model_state_dict(fresh, state)
            after = fresh(input_ids=probe).logits
        torch.save({
            "unpatched": unpatched, "patched": patched, "weight_is_dtensor": weight_is_dtensor,
            "still_patched": still_patched, "fresh_is_patched": engine.is_patched(fresh),
            "diff_before_load": (before - expected).abs().max().item(),
            "diff_after_load": (after - expected).abs().max().item(),
        }, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def train_with_grads(model: torch.nn.Module, batches: list[torch.Tensor]) -> tuple[list[float], list[dict]]:
    """Like :func:`train`, also keeping every parameter's full gradient (gathered from the shards) per step."""
    from torch.distributed.tensor import DTensor

    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads = [], []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads.append({n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                      for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def fused_head_worker(rank: int, out: str) -> None:
    """Unpatched vs ``fused_cross_entropy=True`` under FSDP2, tied and untied: losses and full gradients per step.

    Untied, ``lm_head`` is its own FSDP unit (whole only inside its own forward and backward: the
    fused kernel runs as that forward); tied, it shares its weight with the embedding and stays in
    the root's unit. ``untied, with norm``: the fused run with ``fully_shard([model.lm_head,
    model.model.norm])`` (docs/training.md: the head's gradient not the last of its unit), against
    the unpatched run with the head its own unit, and that with ``fully_shard([model.model.embed_tokens,
    model.model.layers[0]])`` too (the embedding whole for its unit's forward and backward only, not the root's
    whole forward); it also records the unit's parameter order and how
    often the head's forward hooks ran per step (once: the original forward's zero-row call skips them).
    """
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from conftest import tiny_for
    from torch.distributed.fsdp import FSDPModule, fully_shard

    import engine

    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        results, grouped = {}, {}
        for tied in (True, False):
            runs = []
            for fused in (False, True):
                model = tiny_for("qwen3", tie_word_embeddings=tied)
                assert (model.lm_head.weight is model.get_input_embeddings().weight) is tied
                if fused:
                    engine.apply(model, "qwen3", device="cpu", mode="training", fused_cross_entropy=True)
                for layer in model.model.layers:
                    fully_shard(layer)
                if not tied:
                    fully_shard(model.lm_head)
                fully_shard(model)
                assert isinstance(model.lm_head, FSDPModule) is not tied
                runs.append(train_with_grads(model, batches_for(rank)))
            results["tied" if tied else "untied"] = runs
        model = tiny_for("qwen3", tie_word_embeddings=False)
        engine.apply(model, "qwen3", device="cpu", mode="training", fused_cross_entropy=True)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard([model.lm_head, model.model.norm])
        fully_shard(model)
        calls: list[int] = []
        model.lm_head.register_forward_pre_hook(lambda module, args: calls.append(1))
        results["untied, with norm"] = [results["untied"][0], train_with_grads(model, batches_for(rank))]
        group = model.lm_head._get_fsdp_state()._fsdp_param_group
        grouped = {"order": [p._param_fqn for p in group.fsdp_params], "head_calls": len(calls)}
        model = tiny_for("qwen3", tie_word_embeddings=False)  # and the embedding in one unit with the first layer
        engine.apply(model, "qwen3", device="cpu", mode="training", fused_cross_entropy=True)
        fully_shard([model.model.embed_tokens, model.model.layers[0]])
        for layer in model.model.layers[1:]:
            fully_shard(layer)
        fully_shard([model.lm_head, model.model.norm])
        fully_shard(model)
        results["untied, with norm, embedding with layer 0"] = [results["untied"][0],
                                                                train_with_grads(model, batches_for(rank))]
        torch.save(results, f"{out}/fused{rank}.pt")
        torch.save(grouped, f"{out}/grouped{rank}.pt")
        torch.save({fused: head_step_peak_mib(fused, rank) for fused in (False, True)}, f"{out}/peak{rank}.pt")
    finally:
        dist.destroy_process_group()


#: A model whose step is dominated by the head: 1,024 tokens x 32,768 logits (128 MiB in fp32) against a
#: 32,768 x 64 head (8 MiB), as a real vocabulary dominates a real step at 1,024 tokens and more.
WIDE = {"vocab_size": 32_768, "tie_word_embeddings": False}


def head_step_peak_mib(fused: bool, rank: int) -> float:
    """Peak rise of allocated memory (MiB, from the profiler's allocator events) over one FSDP2 step, after a
    warm-up step, of the wide-vocabulary model with ``lm_head`` its own unit, unpatched or with the fused head."""
    from conftest import tiny_for
    from torch.distributed.fsdp import fully_shard
    from torch.profiler import ProfilerActivity, profile

    import engine

    model = tiny_for("qwen3", **WIDE)
    if fused:
        engine.apply(model, "qwen3", device="cpu", mode="training", fused_cross_entropy=True)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model.lm_head)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    ids = torch.randint(0, WIDE["vocab_size"], (1, 1024), generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    level = peak = 0
    for _, nbytes in events:
        level += nbytes
        peak = max(peak, level)
    return peak / (1 << 20)
