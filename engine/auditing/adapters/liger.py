"""``--with liger``: Liger-Kernel's ``apply_liger_kernel_to_<type>(model=model)``, with its defaults.

What a Liger user runs: the function its own table maps the model type to
(``liger_kernel.transformers.monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN``), called with the model
and nothing else: rope, RMSNorm, SwiGLU/GeGLU and the fused linear cross-entropy where that
function defaults to them, its module-level rebindings included. On a machine without a GPU its
Triton kernels run under Triton's CPU interpreter with the engine's shims
(:mod:`engine.kernels.triton_interpret`), as ``patch-engine verify --interpret`` runs them; the
report says so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from engine.auditing.adapters import Adapter, NotClaimed
from engine.errors import MissingDependency
from engine.foundation.versions import installed_version

__all__ = ["claims", "for_model_type"]


def _table() -> dict[str, Any]:
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as exc:
        raise MissingDependency(f"--with liger needs liger-kernel: pip install liger-kernel (or \"patch-engine[cuda]\"): "
                                f"{exc}") from exc
    return dict(MODEL_TYPE_TO_APPLY_LIGER_FN)


def claims() -> list[str]:
    """Every model type Liger's own table maps to an ``apply_liger_kernel_to_*`` function."""
    return sorted(_table())


def for_model_type(model_type: str) -> Adapter:
    table = _table()
    fn = table.get(model_type)
    if fn is None:
        raise NotClaimed(f"liger {installed_version('liger-kernel')} has no apply_liger_kernel_to_* for model type "
                         f"{model_type!r} (its MODEL_TYPE_TO_APPLY_LIGER_FN names {len(table)} types)")

    def apply(model: nn.Module) -> None:
        fn(model=model)

    name = f"liger {installed_version('liger-kernel')}: {fn.__name__}(model=model)"
    return Adapter(name, apply, environment=triton_on_cpu, notes=[_NOTE], reading="Triton's interpreter")


_NOTE = ("Liger's Triton kernels ran on this CPU under Triton's interpreter with the engine's shims "
         "(engine/kernels/triton_interpret), as `patch-engine verify --interpret` runs them; on a GPU they run natively")


@contextlib.contextmanager
def triton_on_cpu(model: nn.Module) -> Iterator[None]:
    """Triton's interpreter for a model on the CPU (Liger's kernels, and those HF kernels loads from it); nothing on a GPU."""
    if next(model.parameters()).device.type != "cpu":
        yield
        return
    from engine.kernels.triton_interpret import interpreting

    with interpreting():
        yield
