"""Where compiling pays: the measured rule the ``compiled`` kernels follow, per op, dtype and mode.

Per op: ``{(dtype, training): the fewest rows compiled, or None: never}``. Rows are the tokens
(times heads for a per-head norm): the input's elements over its last dimension. Below the count,
or where it is ``None``, the call runs the op's torch reference eagerly, which is what the
unpatched model computes. Why: a compiled call pays a fixed cost (dynamo's guards, the AOT
wrapper, under autograd its autograd.Function, inductor's OpenMP region) that only enough rows
hide, and on a CPU shared with other work the OpenMP region stalls; where the compiled kernel
does not win by a margin, ``auto`` must not cost time. Data: ``engine/_data/compiled_rows.yaml``,
measured by benchmarks/compiled_shapes.py and checked on real checkpoints by
``patch-engine bench --checkpoint`` (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

__all__ = ["RULE_FILE", "only_where", "rule", "rule_text"]

RULE_FILE = "compiled_rows.yaml"

Rule = dict[str, dict[tuple[torch.dtype, bool], int | None]]

#: Set by :func:`only_where`: the one (dtype, training) the rule speaks for, the others compiling nowhere.
_ONLY: tuple[torch.dtype, bool] | None = None


@functools.lru_cache(maxsize=1)
def _measured() -> Rule:
    from importlib import resources

    import yaml

    data = yaml.safe_load(resources.files("engine").joinpath("_data", RULE_FILE).read_text(encoding="utf-8"))
    return {op: {(getattr(torch, dtype), mode == "training"): rows
                 for dtype, by_mode in by_dtype.items() for mode, rows in by_mode.items()}
            for op, by_dtype in data["ops"].items()}


def rule() -> Rule:
    """The measured rule (:data:`RULE_FILE`): op -> (dtype, training) -> the fewest rows compiled."""
    if _ONLY is None:
        return _measured()
    return {op: {key: rows for key, rows in by_key.items() if key == _ONLY} for op, by_key in _measured().items()}


@contextlib.contextmanager
def only_where(dtype: torch.dtype, training: bool) -> Iterator[None]:
    """While the block runs, the rule compiles only where a model of ``dtype`` in that mode would.

    Why: a release's self-verification (engine/releases) stands for one model, and verification
    forces the compiled code its rule reaches in every dtype it checks (the bf16 module checks of
    an fp32 model included): for an fp32 training model, inductor compiles (seconds each, cold) of
    code that model never runs. Kernels built inside the block keep the narrowed rule; they belong
    to the tiny model built there.
    """
    global _ONLY
    before, _ONLY = _ONLY, (dtype, training)
    try:
        yield
    finally:
        _ONLY = before


def rule_text(op: str) -> str:
    """The rule for ``op`` in words, for the plan's reason (what ``auto`` picked, and where)."""
    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    where = [f"from {rows} rows in {short.get(dtype, dtype)} {'training' if training else 'inference'}"
             for (dtype, training), rows in rule().get(op, {}).items() if rows is not None]
    # short: it is the plan's `why` cell (the table fits 120 columns)
    return (f"compiled {', '.join(where)}, else torch" if where else "torch: compiled measured faster nowhere") + \
        ": engine/_data/compiled_rows.yaml"
