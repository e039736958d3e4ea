"""The per-rank body of the tensor-parallel test (imported by spawned processes, not a test module).

Each rank loads the same tiny checkpoint with transformers' tensor parallelism
(``from_pretrained(..., tp_plan="auto")``, gloo, 2 ranks) and runs one forward and backward
on the same batch: unpatched; patched after sharding; patched before sharding (``engine.apply``
on the plain model, then transformers' own ``maybe_distribute_model``). It records the loss
and every parameter gradient (DTensor gradients gathered) for the parent to compare, and
what the engine left of transformers' ``tp_forward`` wrappers after apply and revert.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

WORLD = 2


def torch_kernels(family: str) -> dict[str, Any]:
    """The bundled patchset of ``family`` with every kernel pinned to the torch reference."""
    from engine.loader import load_patchset

    ps = load_patchset(family).model_dump(mode="json")
    for patch in ps["patches"]:
        patch["kernel"] = "torch"
    return ps


def step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    from torch.distributed.tensor import DTensor

    import engine

    model.zero_grad(set_to_none=True)
    # torch_path: with fla installed, transformers binds Qwen3-Next's unpatched delta rule to fla,
    # which does not run on CPU; a patched model's own kernels still win under it.
    with engine.torch_path(model):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is not None:
            g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            grads[name] = g.detach().clone()
    return loss.item(), grads


def diff(a: tuple[float, dict[str, torch.Tensor]], b: tuple[float, dict[str, torch.Tensor]]) -> dict[str, Any]:
    (la, ga), (lb, gb) = a, b
    assert ga.keys() == gb.keys() and ga, (sorted(ga.keys() ^ gb.keys()))
    per = {k: (ga[k] - gb[k]).abs().max().item() for k in ga}
    worst = max(per, key=per.get)  # type: ignore[arg-type]
    return {"loss": abs(la - lb), "grad": per[worst], "worst": worst, "n_grads": len(per)}


def load(directory: str, *, tp: bool) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    kwargs: dict[str, Any] = {"tp_plan": "auto"} if tp else {}
    return AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager", **kwargs)


def shard(model: torch.nn.Module) -> torch.nn.Module:
    """transformers' own tensor parallelism on a loaded model, as from_pretrained(tp_plan="auto") does it."""
    from transformers.distributed import DistributedConfig

    cls = type(model)
    config, _, mesh = cls.prepare_distribute_model(DistributedConfig(tp_plan="auto", tp_size=WORLD))
    return cls.maybe_distribute_model(model, config, mesh)


def wrapped_norms(model: torch.nn.Module) -> list[str]:
    """Norms carrying transformers' gradient all-reduce: a ``tp_forward`` instance forward (before 5.25) or,
    since 5.25 (``transformers.distributed``), a ``tp_forward_pre_hook`` that hooks the parameters' gradients."""
    def all_reduced(m: torch.nn.Module) -> bool:
        if getattr(m.__dict__.get("forward"), "__name__", "") == "tp_forward":
            return True
        return any(getattr(h, "__name__", "") == "tp_forward_pre_hook" for h in m._forward_pre_hooks.values())

    return sorted(path for path, m in model.named_modules() if "norm" in path and all_reduced(m))


def run_family(family: str, directory: str, ids: torch.Tensor) -> dict[str, Any]:
    import engine

    ps = torch_kernels(family)
    unpatched = step(load(directory, tp=True), ids)

    after = load(directory, tp=True)
    tp_wrappers = {path: m.__dict__["forward"] for path, m in after.named_modules() if "forward" in m.__dict__}
    engine.apply(after, ps, device="cpu", mode="training")
    patched_after = step(after, ids)
    kept = all(m.__dict__.get("forward") is tp_wrappers[path] for path, m in after.named_modules() if path in tp_wrappers)
    engine.revert(after)
    kept_after_revert = all(
        m.__dict__.get("forward") is tp_wrappers[path] for path, m in after.named_modules() if path in tp_wrappers)
    reverted = step(after, ids)

    before = load(directory, tp=False)
    engine.apply(before, ps, device="cpu", mode="training")
    before = shard(before)
    patched_before = step(before, ids)
    still_patched = engine.is_patched(before)
    engine.revert(before)
    return {
        "after": diff(patched_after, unpatched), "before": diff(patched_before, unpatched),
        "reverted": diff(reverted, unpatched), "tp_norm_wrappers": len(wrapped_norms(after)),
        "wrappers_kept": kept, "wrappers_kept_after_revert": kept_after_revert, "still_patched": still_patched,
    }


def dtensor_plan(directory: str) -> dict[str, str]:
    """How the planner treats a kernel that declares no DTensor support, on a TP-sharded MLP."""
    import engine
    from engine.kernels import registry
    from engine.ops.swiglu import silu_mul_reference

    model = load(directory, tp=True)
    registry.register(registry.KernelProvider(
        name="local_only", op="swiglu", devices=registry.ALL_DEVICES, build=lambda patch: silu_mul_reference,
        description="test kernel without DTensor support"))
    order = registry.AUTO_ORDER[registry.Device.cpu]
    registry.AUTO_ORDER[registry.Device.cpu] = ("local_only", *order)
    out: dict[str, str] = {}
    try:
        ps = torch_kernels("qwen3")
        for patch in ps["patches"]:
            if patch["op"] == "swiglu":
                patch["kernel"] = "auto"
        auto = engine.plan(model, ps, device="cpu", mode="training")
        out["auto"] = next(d.reason for d in auto.decisions if d.op == "swiglu")
        for patch in ps["patches"]:
            if patch["op"] == "swiglu":
                patch["kernel"] = "local_only"
        try:
            engine.plan(model, ps, device="cpu", mode="training")
            out["explicit"] = "no error"
        except engine.DTensorUnsupported as exc:
            out["explicit"] = f"DTensorUnsupported: {exc}"
    finally:
        registry.AUTO_ORDER[registry.Device.cpu] = order
        registry.unregister("local_only", "swiglu")
    return out


def worker(rank: int, out: str, families: list[str]) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    # what torchrun sets: transformers reads the TP size from WORLD_SIZE (without it, no TP at all)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", init_method=f"file://{out}/store", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    try:
        ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(3))
        results: dict[str, Any] = {f: run_family(f, f"{out}/{f}", ids) for f in families}
        results["dtensor_plan"] = dtensor_plan(f"{out}/qwen3")
        torch.save(results, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
