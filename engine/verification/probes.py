"""Inputs for verification: a probe batch, and the inputs every patched module really receives.

Captured from one real forward of the model (and one cached decode step, for functions only
decoding reaches), so shapes, gates and dtypes are the ones the model really uses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from engine import routing
from engine.verification.compare import cast_floats


def probe_batch(model: nn.Module, *, batch: int = 2, seq: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """A deterministic random batch of token ids (with labels) for a causal LM."""
    vocab = int(model.config.vocab_size)
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    return {"input_ids": ids, "labels": ids.clone()}


def capture_inputs(model: nn.Module, decisions: Sequence[Any], batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Run one forward and record the first inputs of every patched module and function."""
    captured: dict[str, Any] = {}
    modules = dict(model.named_modules())
    handles = []
    observers: list[tuple[routing.FunctionRouter, Callable[..., None]]] = []
    for d in decisions:
        if d.site is None:

            def hook(module: nn.Module, args: Any, kwargs: Any, _path: str = d.path) -> None:
                captured.setdefault(_path, (cast_floats(args, torch.float32), cast_floats(kwargs, torch.float32)))

            handles.append(modules[d.path].register_forward_pre_hook(hook, with_kwargs=True))
        else:
            router = routing.router_for(d.site.namespace, d.site.function)
            if router is None:
                continue

            def observe(args: Any, kwargs: Any, _path: str = d.path) -> None:
                captured.setdefault(_path, (cast_floats(args, torch.float32), cast_floats(kwargs, torch.float32)))

            router.observers.append(observe)
            observers.append((router, observe))
    try:
        with torch.no_grad():
            model(**{k: v for k, v in batch.items() if k != "labels"})
            if any(d.path not in captured for d in decisions):
                _decode_step(model, batch)
    finally:
        for h in handles:
            h.remove()
        for router, observe in observers:
            router.observers.remove(observe)
    return captured


def _decode_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    """Prefill, then one cached token: reaches functions only decode calls (a recurrent kernel).

    A model that cannot decode this way simply leaves those functions uncaptured, and the
    verification reports them as never called.
    """
    ids = batch["input_ids"]
    if ids.shape[-1] < 2:
        return
    try:
        out = model(input_ids=ids[:, :-1], use_cache=True)
        cache = getattr(out, "past_key_values", None)
        if cache is not None:
            model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
    except (TypeError, ValueError, NotImplementedError):
        return


def low_precision_dtype(model: nn.Module) -> torch.dtype:
    dtype = next(model.parameters()).dtype
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
