"""DeepSpeed ZeRO-2 and ZeRO-3 with the real ``deepspeed`` package on CPU, two gloo ranks: a patched model, with
and without the fused head, trains like the unpatched one: the same losses and the same gathered gradients.

ZeRO-3 partitions every parameter, the head too (``stage3_param_persistence_threshold: 0``); models are
built as ``from_pretrained`` builds them under ZeRO-3 (``deepspeed.zero.Init``: partitioned from birth),
except one scenario built whole and partitioned by ``deepspeed.initialize``. The fused head runs its
kernel as ``lm_head``'s own forward (engine/ops/sharded_head.py): ZeRO-3's hooks on the head gather it
for the kernel, release it after, and gather it again for its backward, where the gradient formed in
the forward reaches it; it is never registered with the root, which would hold it whole for the
root's whole step. One process group runs every scenario (see tests/deepspeed_worker.py); the parent compares.
"""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")

import torch.multiprocessing as mp
from conftest import tiny_for
from deepspeed_worker import STEPS, WORLD, Scenario, worker

TOL = 1e-5

#: Every patched scenario, and (through ``Scenario.reference``) the unpatched runs they are compared with.
SCENARIOS = [
    Scenario(3, tied=False, patch="layers", when="before"),
    Scenario(3, tied=True, patch="fused", when="before"),
    Scenario(3, tied=False, patch="fused", when="before"),
    Scenario(3, tied=True, patch="fused", when="after"),
    Scenario(3, tied=False, patch="fused", when="after"),
    Scenario(3, tied=False, patch="fused", when="after", zero_init=False),
    Scenario(2, tied=True, patch="layers", when="after"),
    Scenario(2, tied=False, patch="fused", when="before"),
    Scenario(2, tied=True, patch="fused", when="after"),
]
REFERENCES = list(dict.fromkeys(s.reference() for s in SCENARIOS))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, dict]]:
    out = tmp_path_factory.mktemp("ds")
    folders = {}
    for tied in (True, False):
        folder = out / ("tied" if tied else "untied")
        tiny_for("qwen3", tie_word_embeddings=tied).save_pretrained(folder)
        folders[folder.name] = str(folder)
    runs = [asdict(s) for s in REFERENCES + SCENARIOS]
    mp.spawn(worker, args=(str(out), folders, runs), nprocs=WORLD, join=True)
    return [torch.load(out / f"ds{rank}.pt") for rank in range(WORLD)]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_zero_patched_trains_like_unpatched(scenario: Scenario, results: list[dict[str, dict]]) -> None:
    for rank, per_rank in enumerate(results):
        run, ref = per_rank[scenario.name], per_rank[scenario.reference().name]
        assert run["patched"] and not ref["patched"]
        assert run["tied"] is scenario.tied
        assert run["head_partitioned"] is (scenario.stage == 3)  # the head really is a shard under ZeRO-3
        # the fused kernel runs as lm_head's forward: its own hooks gather the head, not the root's
        assert not run["head_on_root"]
        assert len(run["losses"]) == STEPS
        assert max(abs(a - b) for a, b in zip(run["losses"], ref["losses"])) <= TOL, (rank, run["losses"], ref["losses"])
        for step in range(STEPS):
            assert _max_diff(run["grads"][step], ref["grads"][step]) <= TOL, (rank, step)
    # the gradients compared are the gathered (reduced) ones: the same on both ranks, whose batches differ
    assert results[0][scenario.name]["losses"] != results[1][scenario.name]["losses"]
    for step in range(STEPS):
        assert _max_diff(results[0][scenario.name]["grads"][step], results[1][scenario.name]["grads"][step]) <= 1e-6
    assert any(g.abs().max() > 0 for g in results[0][scenario.name]["grads"][0].values())
