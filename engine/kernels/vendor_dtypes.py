"""The dtypes where a vendor kernel passes the engine's verifier, measured; ``kernel: auto`` reads them.

Why: on CUDA, Triton computes an fp32 ``tl.dot`` in TF32 unless the kernel says otherwise, and
some kernels keep intermediates in bf16 where transformers' torch path computes in fp32. Run under
Triton's interpreter (``verify --device cuda --interpret``), such a kernel fails our own verifier
in a model of that dtype, while torch's default fp32 matmul on CUDA is not TF32: picking it by
default would make verify fail and, unverified, train less precisely than the original. The
measurements are data (``engine/_data/vendor_dtypes.yaml``, each entry citing its run and the
Triton reason); this module only reads them. ``auto`` passes such a kernel over
(:mod:`engine.planning.kernel_choice`); a kernel named explicitly is kept, with the reason as a warning.
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

import torch
import yaml

__all__ = ["DTYPE_NAMES", "unverified"]

DTYPE_NAMES: dict[torch.dtype, str] = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@functools.cache
def _table() -> dict[tuple[str, str], dict[str, Any]]:
    text = resources.files("engine").joinpath("_data", "vendor_dtypes.yaml").read_text(encoding="utf-8")
    return {(e["provider"], e["op"]): e for e in yaml.safe_load(text)}


def unverified(provider: str, op: str, device: str, dtype: torch.dtype | None) -> str | None:
    """Why ``provider``'s ``op`` on ``device`` fails (or was not shown to pass) the verifier in a ``dtype``
    model, or ``None``; ``None`` also when the dtype is unknown or not one the verifier judges.
    """
    entry = _table().get((provider, op))
    name = DTYPE_NAMES.get(dtype) if dtype is not None else None
    if entry is None or name is None or name in entry["passes"] or device not in entry["devices"]:
        return None
    passes = ", ".join(entry["passes"]) or "none"
    return f"{entry['reason']} (passes verify in: {passes}; not in {name})"
