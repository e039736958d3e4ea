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

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["own_construction"]


@contextmanager
def own_construction(device: torch.device | str = "cpu") -> Iterator[None]:
    """New tensors on ``device``, fp32 by default, whatever device or default dtype the caller set; the caller's
    random state as it was afterwards.

    The innermost ``torch.device`` context decides where factory functions put tensors, so this one
    wins over an enclosing ``torch.device("meta")``; the default dtype is restored on the way out. The
    tiny model seeds torch (``build_tiny_model(seed=0)``): a self-verifying ``apply`` reseeded the user's
    generator, so after ``set_seed(42)`` the dropout masks and data order of a patched run differed from
    the unpatched one (a transformers test's random dummy inputs lost their padding under mllama).
    """
    device = torch.device(device)
    accelerators = [] if device.type in ("cpu", "meta") else [device.index or 0]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with torch.device(device), torch.random.fork_rng(devices=accelerators, device_type=device.type):
            yield
    finally:
        torch.set_default_dtype(default)
