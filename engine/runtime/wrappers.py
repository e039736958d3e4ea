"""Seeing through wrappers that hold a transformers model and delegate to it.

Why: ``torch.compile(model)`` returns an ``OptimizedModule`` around the model, peft's
``get_peft_model`` a ``PeftModel``, DDP and FSDP (v1) a ``DistributedDataParallel`` /
``FullyShardedDataParallel`` module, ``deepspeed.initialize`` a ``DeepSpeedEngine`` (its
``module``). If the engine stored its patch state on a wrapper,
the same model could be patched twice (once through the wrapper, once directly: two
reverts then still left forwards patched), ``is_patched(inner)`` would say no, and
``engine.revert(peft.get_base_model())`` would find nothing to revert. So every public
entry point (plan, apply, revert, is_patched, verify) goes through :func:`unwrap` first,
and the state always lives on the transformers model, whichever order the user wraps and
patches in. FSDP2's ``fully_shard``, accelerate's hooks and ZeRO-3's parameter hooks change the model in
place and need no unwrapping.

peft is detected by duck type (a ``get_base_model()`` method returning another module), so
it is never imported here; the torch wrappers by their classes, imported lazily.
"""

from __future__ import annotations

from torch import nn

__all__ = ["unwrap"]

_MAX_DEPTH = 8  # a wrapper of a wrapper is possible (compile(DDP(peft(model)))); a cycle is not followed


def unwrap(model: nn.Module) -> nn.Module:
    """The innermost model behind compile, DDP / DataParallel / FSDP and peft wrappers; else ``model``."""
    for _ in range(_MAX_DEPTH):
        inner = _inner(model)
        if inner is None or inner is model:
            return model
        model = inner
    return model


def _inner(model: nn.Module) -> nn.Module | None:
    """The module ``model`` delegates to, if it is a wrapper we know; else None."""
    if _is_instance(model, "torch._dynamo.eval_frame", "OptimizedModule"):
        inner = model._modules.get("_orig_mod")
        return inner if isinstance(inner, nn.Module) else None
    if (
        _is_instance(model, "torch.nn.parallel", "DistributedDataParallel")
        or _is_instance(model, "torch.nn.parallel", "DataParallel")
        or _is_instance(model, "torch.distributed.fsdp", "FullyShardedDataParallel")
        or _is_instance(model, "deepspeed.runtime.engine", "DeepSpeedEngine")
    ):
        inner = model._modules.get("module")
        return inner if isinstance(inner, nn.Module) else None
    get_base = getattr(type(model), "get_base_model", None)
    if callable(get_base):
        inner = model.get_base_model()  # type: ignore[operator]
        return inner if isinstance(inner, nn.Module) else None
    return None


def _is_instance(obj: object, module: str, name: str) -> bool:
    """``isinstance(obj, module.name)``, without importing ``module`` unless ``obj``'s class could be it."""
    if not any(cls.__name__ == name for cls in type(obj).__mro__):
        return False
    import importlib

    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):  # torch without distributed support
        return False
    return isinstance(obj, cls)
