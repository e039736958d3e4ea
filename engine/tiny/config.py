"""A tiny config for any model type, derived from its config class's own defaults.

Why: the scaffold must build a tiny model of a family nobody has written a ``tiny_model``
block for yet. The defaults of a config class describe the flagship checkpoint (61 layers,
256 experts, a 129k vocabulary); the rules below shrink every size-like key they recognise
*by its name*, whatever the family, so no family needs its own Python. A family whose
config still does not build from them gets a clear error naming the model type, and the
user passes the missing keys (``engine.scaffold(model_type, config={...})``).

The rules keep the *structure* a patchset has to see: every distinct layer type of
``layer_types`` stays present (one layer each, at least two layers), a MoE model keeps one
dense layer next to its sparse ones (``first_k_dense_replace``, ``mlp_only_layers``), and
token ids stay inside the tiny vocabulary.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from engine.runtime.release import bundled_covering
from engine.tiny import BASE_KWARGS

__all__ = ["SIZE_RULES", "derive_tiny_config", "tiny_overrides"]

_Rule = Callable[[str, Any], Any]


def _const(value: Any) -> _Rule:
    return lambda key, old: value


#: ``(pattern on the key, new value or function)`` for int-valued keys, first match wins.
#: Keys of :data:`engine.tiny.BASE_KWARGS` are set by the base sizes and never reach these.
SIZE_RULES: tuple[tuple[str, Any], ...] = (
    (r"head_dim$", 16),                                   # head_dim, qk_rope_head_dim, v_head_dim, ...
    (r"^(n_routed_experts|num_local_experts|num_experts|moe_num_experts|n_experts)$", 4),
    (r"^(num_experts_per_tok|moe_k|moe_topk|top_k|num_experts_per_token)$", 2),
    (r"^(n_shared_experts|num_shared_experts|moe_num_shared_experts)$", 1),
    (r"^(n_group|topk_group)$", 1),
    (r"intermediate_size", 32),                           # moe_/shared_expert_/... intermediate sizes
    (r"lora_rank$", 16),
    (r"^linear_num_key_heads$", 2),
    (r"^linear_num_value_heads$", 4),
    (r"^first_k_dense_replace$", 1),                      # one dense layer, then sparse ones
    (r"^moe_layer_start_index$", 1),
    (r"^(decoder_sparse_step|moe_layer_interval|interleave_moe_layer_step)$", 1),
    (r"^(sliding_window|attention_chunk_size)$", 8),
    (r"^(max_position_embeddings|original_max_position_embeddings)$", 128),
    (r"^(num_nextn_predict_layers)$", 0),
    (r"vocab_size", BASE_KWARGS["vocab_size"]),           # vocab_size_per_layer_input, ...
    (r"^hidden_size_", 16),                               # hidden_size_per_layer_input, ...
)

#: Keys whose ``None`` default is a size the model needs anyway (hunyuan's head_dim, dots1's
#: expert counts): the size rule applies to them too. Other ``None`` keys mean "off" and stay.
_NONE_MEANS_UNSET = re.compile(r"head_dim$|experts$|experts_per_tok$")

#: List-valued keys: a new value given the number of layers.
LIST_RULES: dict[str, Callable[[list[Any], int], list[Any]]] = {
    "mlp_only_layers": lambda old, n: [0],                # one dense layer next to the sparse one
    "moe_layers": lambda old, n: list(range(1, n)),
    "no_rope_layers": lambda old, n: [1] * n,
    "full_attn_idxs": lambda old, n: [i for i in range(n) if i % 2 == 0],
}


def _distinct(values: list[Any]) -> list[Any]:
    return list(dict.fromkeys(values))


def derive_tiny_config(model_type: str) -> dict[str, Any]:
    """Overrides (on top of :data:`engine.tiny.BASE_KWARGS`) for a tiny model of ``model_type``."""
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        import difflib

        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=3)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise bundled_covering(model_type) or ValueError(
            f"unknown model type {model_type!r} (not a transformers config model_type){hint}"
        )
    return tiny_overrides(CONFIG_MAPPING[model_type]().to_dict())


def tiny_overrides(defaults: dict[str, Any]) -> dict[str, Any]:
    """The size overrides :func:`derive_tiny_config` applies, for any config's dict.

    Why separate: a checkpoint folder's config (its code maybe not in transformers, see
    :mod:`engine.scaffolding.source`) is shrunk by the same rules, from its own values.
    """
    overrides: dict[str, Any] = {}
    layers = BASE_KWARGS["num_hidden_layers"]
    layer_types = defaults.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        kinds = _distinct(layer_types)
        layers = max(layers, len(kinds))
        # the first-appearing kinds, the default's pattern kept (e.g. sliding before full)
        overrides["layer_types"] = [*kinds, *kinds][:layers] if len(kinds) < layers else kinds
        if layers != BASE_KWARGS["num_hidden_layers"]:
            overrides["num_hidden_layers"] = layers
    if isinstance(defaults.get("num_key_value_heads"), int) and defaults.get("num_key_value_heads") == defaults.get("num_attention_heads"):
        overrides["num_key_value_heads"] = BASE_KWARGS["num_attention_heads"]  # keep MHA (MLA needs it)
    vocab = BASE_KWARGS["vocab_size"]
    next_id = iter(range(vocab))
    for key, value in defaults.items():
        if key in BASE_KWARGS or key in overrides or isinstance(value, bool):
            continue
        if isinstance(value, list) and key in LIST_RULES:
            overrides[key] = LIST_RULES[key](value, layers)
        elif key.endswith("_token_id"):
            ids = value if isinstance(value, list) else [value]
            if any(isinstance(i, int) and i >= vocab for i in ids):
                small = [next(next_id) for _ in ids]
                overrides[key] = small if isinstance(value, list) else small[0]
        elif isinstance(value, int) or (value is None and _NONE_MEANS_UNSET.search(key)):
            for pattern, new in SIZE_RULES:
                if re.search(pattern, key):
                    target = new(key, value) if callable(new) else new
                    if target != value:
                        overrides[key] = target
                    break
    return overrides
