"""The per-rank body of the DeepSpeed tests (imported by spawned processes, so not a test module).

One process group runs every scenario (starting one per scenario would cost more than the
scenarios): each builds a tiny Qwen3 the way a user would (``from_pretrained`` of a folder the
parent wrote; under ZeRO-3 inside ``HfDeepSpeedConfig``, so transformers builds it with
``deepspeed.zero.Init`` and every parameter is partitioned from the start), patches it before or
after ``deepspeed.initialize`` (or not at all), and trains a few AdamW steps on this rank's own
batches. After each backward the full gradients are gathered (``safe_get_full_grad``, a collective)
and kept. Results go to ``<dir>/ds<rank>.pt`` for the parent to compare.
"""

from __future__ import annotations

import os
import sys
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported anywhere

import torch
import torch.distributed as dist

STEPS = 2
LR = 1e-3
WORLD = 2


@dataclass(frozen=True)
class Scenario:
    stage: int  # ZeRO stage: 2 or 3
    tied: bool  # tie_word_embeddings
    patch: str  # "none", "layers" (the qwen3 patchset) or "fused" (and fused_cross_entropy=True)
    when: str = "before"  # apply "before" or "after" deepspeed.initialize
    zero_init: bool = True  # stage 3: build the model under zero.Init (as from_pretrained does with ZeRO-3)

    @property
    def name(self) -> str:
        init = "-zinit" if self.stage == 3 and self.zero_init else ""
        return f"z{self.stage}-{'tied' if self.tied else 'untied'}-{self.patch}-{self.when}{init}"

    def reference(self) -> Scenario:
        """The unpatched run this one is compared with (same stage, embeddings and construction)."""
        return Scenario(self.stage, self.tied, "none", "before", self.zero_init)


def ds_config(stage: int) -> dict[str, Any]:
    """ZeRO on CPU with the head really partitioned (no parameter is kept whole for being small)."""
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero |= {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 0}
    return {
        "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "zero_optimization": zero,
        "zero_allow_untested_optimizer": True, "steps_per_print": 10**9, "wall_clock_breakdown": False,
    }


def batches_for(rank: int, vocab: int = 256, seq: int = 16) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, vocab, (2, seq), generator=gen) for _ in range(STEPS)]


def build(scenario: Scenario, folder: str) -> tuple[Any, Any]:
    """``(deepspeed engine, HfDeepSpeedConfig or None)``: the model from ``folder``, patched as the scenario says."""
    import deepspeed
    from training_helpers import qwen3_patchset
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    import engine

    config = ds_config(scenario.stage)
    keep = HfDeepSpeedConfig(config) if scenario.stage == 3 and scenario.zero_init else None  # zero.Init in from_pretrained
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if scenario.stage == 3 and scenario.zero_init:
        assert model.lm_head.weight.numel() == 0, "built outside zero.Init"
    model.train()

    def patch(target: Any) -> None:
        if scenario.patch != "none":
            # unverified="trust": the dict is the test's own content, which apply would verify first on a tiny
            # model, and that cannot run inside a DeepSpeed process (ZeRO-3 replaces F.linear process-wide, so the
            # fp64 truth fails: VerificationNotRun, loud, never a verdict); this test compares the losses instead
            engine.apply(target, qwen3_patchset(), device="cpu", mode="training",
                         fused_cross_entropy=scenario.patch == "fused", unverified="trust")

    if scenario.when == "before":
        patch(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    ds_engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    if scenario.when == "after":
        patch(ds_engine)  # the DeepSpeedEngine itself: the engine unwraps it
    return ds_engine, keep


def train(ds_engine: Any, batches: list[torch.Tensor]) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    from deepspeed.utils import safe_get_full_grad

    losses, grads = [], []
    for ids in batches:
        loss = ds_engine(input_ids=ids, labels=ids).loss
        ds_engine.backward(loss)
        grads.append({n: safe_get_full_grad(p).detach().clone() for n, p in ds_engine.module.named_parameters()})
        ds_engine.step()
        losses.append(loss.item())
    return losses, grads


def worker(rank: int, out: str, folders: dict[str, str], scenarios: list[dict[str, Any]]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(WORLD)})
    import deepspeed

    import engine

    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=120))
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the group above
    try:
        results = {}
        for fields in scenarios:
            scenario = Scenario(**fields)
            ds_engine, _keep = build(scenario, folders["tied" if scenario.tied else "untied"])
            inner = ds_engine.module
            patched = engine.is_patched(inner)
            losses, grads = train(ds_engine, batches_for(rank))
            head = inner.lm_head.weight
            results[scenario.name] = {
                "scenario": asdict(scenario), "losses": losses, "grads": grads, "patched": patched,
                "head_partitioned": scenario.stage == 3 and head.numel() == 0 and head.ds_numel > 0,
                "tied": head is inner.get_input_embeddings().weight,
                # ZeRO-3 gathers a parameter registered with the root for the root's whole step
                "head_on_root": id(head) in getattr(inner, "_external_params", {}),
            }
            if patched:
                engine.revert(inner)
            del ds_engine, inner, _keep
        torch.save(results, f"{out}/ds{rank}.pt")
    finally:
        dist.destroy_process_group()
