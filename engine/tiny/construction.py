"""The engine's own tiny models are built in a context of their own, not the caller's.

Why: the engine builds and runs a tiny model (a release's self-verification) while the user's
model is being built, and so inside whatever context builds it: ``with torch.device("meta")``
(FSDP2's meta init; transformers' ``from_pretrained`` builds every model that way, in the dtype it
loads, set as torch's default). There every tensor the tiny model made was a meta tensor, its
verification failed ("Cannot copy out of meta tensor"), and that failure was cached as the
release's verdict, so every later ``apply`` of that patchset, in any process, refused a model
the release runs correctly. Found by transformers' own tests on patched models (deepseek_v32
and deepseek_v4 under 5.15.1, tests/hf_suite/).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["callers_random_state", "own_construction"]


@contextmanager
def own_construction(device: torch.device | str = "cpu") -> Iterator[None]:
    """New tensors on ``device``, fp32 by default, whatever device or default dtype the caller set.

    And not partitioned: while a ZeRO-3 ``HfDeepSpeedConfig`` is alive, transformers builds every model
    inside ``deepspeed.zero.Init`` (parameters scattered over the ranks, gathered by collectives), so a
    tiny model that one rank builds for its self-verification, while the others wait on the verdict's
    lock, would block on (or break) a collective. The config is hidden for the block.

    The innermost ``torch.device`` context decides where factory functions put tensors, so this one
    wins over an enclosing ``torch.device("meta")``; the default dtype is restored on the way out.
    """
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    zero3 = sys.modules.get("transformers.integrations.deepspeed")
    ds_config = getattr(zero3, "_hf_deepspeed_config_weak_ref", None)
    if ds_config is not None:  # a ZeRO-3 HfDeepSpeedConfig alive: transformers would build the tiny model in zero.Init
        zero3._hf_deepspeed_config_weak_ref = None
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(default)
        if ds_config is not None:
            zero3._hf_deepspeed_config_weak_ref = ds_config


@contextmanager
def callers_random_state(device: torch.device | str = "cpu") -> Iterator[None]:
    """The caller's random state (CPU, and ``device``'s where it is an accelerator) as it was, afterwards.

    Why: the tiny model is built seeded (``build_tiny_model(seed=0)``), and a self-verifying ``apply``
    reseeded the user's generator, so after ``set_seed(42)`` the dropout masks and data order of a
    patched run differed from the unpatched one.
    """
    device = torch.device(device)
    accelerators = [] if device.type in ("cpu", "meta") else [device.index or 0]
    with torch.random.fork_rng(devices=accelerators, device_type=device.type):
        yield
