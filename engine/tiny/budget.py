"""The size budget of a self-verification's tiny model, checked from its config before anything is built.

Why: a patchset's ``tiny_model.config`` is data from whoever wrote the YAML, and the engine
builds it on a plain ``apply`` outside the verified range (the self-verification). Hidden size
1024 with 48 layers made one ``apply`` run 63 s and take 9.8 GB before failing. A tiny model
only has to show a patch the structure it replaces (every bundled one is a few layers of width
64 or so, well under a million parameters), so a config far beyond that is refused at once,
saying why and the budget, before transformers builds a config object or a single tensor.

The estimate counts what grows with a config: parameters (attention, MLP times experts,
embeddings, per layer, per sub-config such as a vision tower), position tables
(``max_position_embeddings`` times the attention width) and a vision tower's patches (their
activations and attention scores). It is an estimate by key names, deliberately generous
(an over-count refuses sooner, never later), applied twice: to the patchset's own values over
the tiny base sizes (a huge value is refused before its config class runs), then to the whole
config with the class's defaults (a size the patchset left at a flagship default).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from engine.errors import PatchsetError

__all__ = ["MAX_TINY_ELEMENTS", "check_tiny_budget", "estimate_elements"]

#: The budget, in estimated elements (fp32: 4 bytes each; the verifier holds a few copies: fp32,
#: bf16, an fp64 truth, gradients). The largest bundled tiny model estimates 4.3M (gemma4, whose
#: vision tower's patches dominate; 0.8M real elements), the others under 0.4M (every bundled one is
#: checked in tests/test_bounds.py); 32M leaves room for a user's larger probe and refuses the 200M+
#: of hidden 1024 x 48 layers long before anything is built.
MAX_TINY_ELEMENTS = 32_000_000

_HIDDEN = re.compile(r"^(hidden_size|d_model|n_embd|embed_dim|dim|hidden_dim|width|projection_dim)$")
_INTERMEDIATE = re.compile(r"intermediate_size$|^(ffn_dim|d_ff|n_inner|mlp_dim|ffn_hidden_size)$")
_LAYERS = re.compile(r"^(num_hidden_layers|n_layers?|num_layers|depth|num_\w+_layers|\w+_num_layers)$")
_HEADS = re.compile(r"^(num_attention_heads|n_heads?|num_heads|encoder_attention_heads)$")
_HEAD_DIM = re.compile(r"head_dim$")
_EXPERTS = re.compile(r"^(n_routed_experts|num_local_experts|num_experts|moe_num_experts|n_experts)$")
_VOCAB = re.compile(r"vocab_size")
_POSITIONS = re.compile(r"max_position_embeddings$")


def _ints(config: Mapping[str, Any], pattern: re.Pattern[str]) -> list[int]:
    return [v for k, v in config.items() if isinstance(k, str) and pattern.search(k) and isinstance(v, int)
            and not isinstance(v, bool) and v > 0]


def _largest(config: Mapping[str, Any], pattern: re.Pattern[str], default: int = 0) -> int:
    return max(_ints(config, pattern), default=default)


def _size(value: Any) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return max(value, 0)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return max(max(value), 0)
    return 0


def estimate_elements(config: Mapping[str, Any]) -> tuple[int, str]:
    """``(estimated elements, what they are)`` of a model built from ``config`` (nested sub-configs summed)."""
    total, parts = 0, []
    for key, value in config.items():
        if isinstance(value, Mapping):  # text_config, vision_config, ...
            sub, _ = estimate_elements(value)
            if sub:
                total += sub
                parts.append(f"{key} ~{_millions(sub)}")
    hidden = _largest(config, _HIDDEN)
    if not hidden or (parts and not _ints(config, _LAYERS)):  # a composite's own sizes without layers: legacy copies
        return total, ", ".join(parts)
    inter = _largest(config, _INTERMEDIATE, 4 * hidden)
    layers = _largest(config, _LAYERS, 1)
    heads = _largest(config, _HEADS, 1)
    width = max(hidden, heads * _largest(config, _HEAD_DIM))
    experts = _largest(config, _EXPERTS, 0)
    per_layer = 4 * hidden * width + 3 * hidden * inter * (experts + 1 if experts else 1)
    params = layers * per_layer + 2 * _largest(config, _VOCAB) * hidden
    positions = _largest(config, _POSITIONS) * width
    image, patch = _size(config.get("image_size")), _size(config.get("patch_size"))
    tokens = (image // patch) ** 2 if image and patch else 0
    vision = layers * tokens * (hidden + tokens * heads)
    total += params + positions + vision
    parts.append(f"{layers} layers x hidden {hidden} x intermediate {inter}" + (f" x {experts} experts" if experts else "")
                 + (f", {tokens} image patches" if tokens else ""))
    return total, ", ".join(parts)


def _millions(n: int) -> str:
    return f"{n / 1e6:.1f}M" if n < 1e9 else f"{n:.2e}"


def _refusal(model_type: str, elements: int, what: str, file: str | None, stage: str) -> PatchsetError:
    return PatchsetError(
        f"its tiny {model_type} model would hold about {_millions(elements)} elements ({what}{stage}), over the "
        f"self-verification's budget of {_millions(MAX_TINY_ELEMENTS)}; nothing was built. A tiny model only has to "
        "show each patch the structure it replaces: a few layers of hidden size 64 or so, as every bundled patchset's "
        "tiny_model (engine.tiny.BASE_KWARGS). Shrink the sizes above",
        file=file, key="tiny_model.config",
    )


def check_tiny_budget(model_type: str, config: Mapping[str, Any], *, file: str | None = None) -> None:
    """Refuse (:class:`PatchsetError` at ``tiny_model.config``) a tiny model whose estimate is over :data:`MAX_TINY_ELEMENTS`.

    First the patchset's own values over the tiny base sizes (no config class runs: a value such as
    ``num_hidden_layers: 10**9`` never reaches one), then the whole config with its class's defaults.
    """
    from engine.tiny import BASE_KWARGS, _composite_kwargs, _transformers_classes, is_composite

    raw = {**BASE_KWARGS, **config}
    elements, what = estimate_elements(raw)
    if elements > MAX_TINY_ELEMENTS:
        raise _refusal(model_type, elements, what, file, "")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        return  # check_tiny_config says what is wrong with the type
    composite = is_composite(CONFIG_MAPPING[model_type])
    try:
        config_cls, _ = _transformers_classes(model_type, composite)
        kwargs = _composite_kwargs(config_cls, dict(config)) if composite else raw
        full = config_cls(**kwargs).to_dict()
    except Exception:  # noqa: BLE001  (building the model reports what the config itself gets wrong)
        return
    elements, what = estimate_elements(full)
    if elements > MAX_TINY_ELEMENTS:
        raise _refusal(model_type, elements, what, file, ", with the config class's defaults for the sizes not given")
