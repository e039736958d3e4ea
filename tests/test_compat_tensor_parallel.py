"""Tensor parallelism (transformers' ``tp_plan="auto"``, 2 gloo processes): the same loss and gradients.

transformers' TP installs ``module.forward = tp_forward`` on sharded linears and on
``replicated_with_grad_allreduce`` norms (Qwen3's per-head ``q_norm``/``k_norm``, whose
gradients cover only this rank's heads until that wrapper's hook all-reduces them). The
engine's patch goes beneath those wrappers, in either order (apply after sharding, or
before it), so the loss and *every* parameter gradient equal the unpatched TP run; on the
code before this test the norms' gradient all-reduce was lost and q/k-norm gradients were
wrong while the loss was right. Also: a kernel that takes no DTensor inputs is passed over
by ``auto`` and refused when named, on a sharded MLP.
"""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
from conftest import tiny_for
from tp_worker import WORLD, worker

TOL = 1e-5
FAMILIES = ["qwen3", "qwen3_moe", "qwen3_next"]


def test_tensor_parallel_patched_gradients_equal_unpatched(tmp_path) -> None:
    for family in FAMILIES:
        tiny_for(family).save_pretrained(tmp_path / family)
    mp.spawn(worker, args=(str(tmp_path), FAMILIES), nprocs=WORLD, join=True)
    for rank in range(WORLD):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for family in FAMILIES:
            r = results[family]
            for order in ("after", "before", "reverted"):
                d = r[order]
                assert d["loss"] <= TOL and d["grad"] <= TOL, (family, order, d)
            assert r["wrappers_kept"] and r["wrappers_kept_after_revert"], family
            assert r["still_patched"], family
        assert results["qwen3"]["tp_norm_wrappers"] == 4  # q_norm and k_norm in both layers
        plan = results["dtensor_plan"]
        placement = "model.layers.0.mlp (Qwen3MLP) has DTensor parameter 'gate_proj.weight' with placements (Shard(dim=0),)"
        assert f"local_only: takes no DTensor inputs ({placement})" in plan["auto"], plan
        assert plan["auto"].startswith("auto: first available for cpu"), plan  # torch, which takes DTensors
        assert plan["explicit"].startswith("DTensorUnsupported: local_only does not take DTensor inputs"), plan
        assert placement in plan["explicit"], plan
