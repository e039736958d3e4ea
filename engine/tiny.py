"""Tiny transformers models built from a config alone, with weights perturbed away from init.

Why perturb: a fresh norm weight is all ones (or all zeros for ``1 + w`` norms), where
``w`` and ``1 + w`` or two cast orders can coincide; a test on fresh weights proves little.
Every parameter is moved by a random amount *away* from its init value (never landing on
exactly 0 or 1), so norm weights end up around 1 for ``weight`` norms and around 0 for
``one_plus_weight`` norms, as in trained models.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from engine.errors import InvalidArgument, PatchsetError

__all__ = ["build_tiny_for", "build_tiny_model", "check_tiny_config", "perturb_", "tiny_config_kwargs"]

#: Config keys that count or size something: a tiny model needs them positive.
_POSITIVE = re.compile(r"^num_\w*(layers|heads|experts)$|_size$|_dim$|^max_position_embeddings$")

#: Keyword arguments every tiny model starts from; a patchset's ``tiny_model.config`` adds to them.
BASE_KWARGS: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 128,
}


def tiny_config_kwargs(overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    return {**BASE_KWARGS, **(overrides or {})}


def perturb_(model: nn.Module, *, seed: int = 0, scale: float = 0.2) -> nn.Module:
    """Move every floating parameter away from its value by ``+-[scale/4, scale]`` (in place)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point():
                continue
            magnitude = torch.empty(p.shape).uniform_(scale / 4, scale, generator=gen)
            sign = torch.randint(0, 2, p.shape, generator=gen) * 2 - 1
            p.add_((magnitude * sign).to(p.dtype))
    return model


def build_tiny_model(
    model_type: str,
    config: dict[str, Any] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    perturb: bool = True,
    attn_implementation: str | None = "eager",
) -> nn.Module:
    """A causal LM of ``model_type`` with the tiny base sizes plus ``config`` overrides."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    kwargs = tiny_config_kwargs(config)
    cfg = AutoConfig.for_model(model_type, **kwargs)
    if attn_implementation is not None:
        cfg._attn_implementation = attn_implementation
    model = AutoModelForCausalLM.from_config(cfg)
    if perturb:
        perturb_(model, seed=seed)
    return model.to(dtype)


def _patchset_file(patchset: Any) -> str | None:
    """The file a patchset was loaded from, when it came from exactly one."""
    files = {origin[0] for origin in getattr(patchset, "_origins", {}).values() if origin[0]}
    return files.pop() if len(files) == 1 else None


def check_tiny_config(model_type: str, config: dict[str, Any], *, file: str | None = None) -> None:
    """Refuse a ``tiny_model`` that cannot build a model, before transformers fails with a traceback.

    Checks the model type exists, every value has the type of the config's default (an int
    where transformers expects an int), and counts and sizes are positive. Raises
    :class:`PatchsetError` keyed ``tiny_model.config.<key>``, or :class:`InvalidArgument` for
    an unknown model type.
    """
    from transformers import CONFIG_MAPPING, AutoConfig

    if model_type not in CONFIG_MAPPING:
        import difflib

        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=3)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise InvalidArgument(f"unknown model type {model_type!r} (not a transformers config model_type){hint}")
    defaults = AutoConfig.for_model(model_type)
    for key, value in config.items():
        where = f"tiny_model.config.{key}"
        default = getattr(defaults, key, None)
        kinds = (bool,) if isinstance(default, bool) else (int,) if isinstance(default, int) else (
            (int, float) if isinstance(default, float) else None
        )
        if kinds and (not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool))):
            expected = " or ".join(k.__name__ for k in kinds)
            raise PatchsetError(
                f"{value!r} is a {type(value).__name__}, but {model_type} configs take an {expected} here "
                f"(default {default!r}); write it without quotes", file=file, key=where,
            )
        if isinstance(value, int) and not isinstance(value, bool) and _POSITIVE.search(key) and value <= 0:
            raise PatchsetError(
                f"{value} is not a valid size: {key} counts or sizes part of the model and must be a positive "
                f"integer (a tiny model uses e.g. {BASE_KWARGS.get(key, 2)})", file=file, key=where,
            )


def build_tiny_for(
    patchset: Any, model_type: str | None = None, *, dtype: torch.dtype = torch.float32, seed: int = 0
) -> nn.Module:
    """The tiny model a patchset's ``tiny_model`` declares; a bad declaration is a :class:`PatchsetError`.

    Why: ``patch-engine verify mine.yaml`` with ``head_dim: 0`` used to end in a
    ZeroDivisionError traceback from inside transformers; now it names the key and the fix.
    """
    tiny = patchset.tiny_model
    mt = model_type or (tiny.model_type if tiny and tiny.model_type else patchset.model_types[0])
    config = dict(tiny.config) if tiny else {}
    file = _patchset_file(patchset)
    check_tiny_config(mt, config, file=file)
    try:
        model = build_tiny_model(mt, config, dtype=dtype, seed=seed)
        from engine.hub_functions import torch_path

        with torch.no_grad(), torch_path(model):  # values that build but do not fit (heads vs kv heads) fail here
            model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    except Exception as exc:  # whatever transformers' config, model __init__ or forward raises for these values
        raise PatchsetError(
            f"building a tiny {mt} model from it failed: {type(exc).__name__}: {str(exc).strip()}. "
            f"Fix the values (keyword arguments of AutoConfig.for_model({mt!r}))", file=file, key="tiny_model.config",
        ) from exc
    return model
