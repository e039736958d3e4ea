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

import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.runtime.release import bundled_covering
from engine.tiny import BASE_KWARGS

__all__ = [
    "SIZE_RULES", "SUB_BASE", "TYPES_FILE", "derive_tiny_config", "generative_types", "tiny_overrides", "type_overrides",
]

#: Per-type keys no size rule can derive (a hybrid's attention layers, a vision tower's sizes that must
#: agree with each other): data, one entry per model type, each with the reason in a comment.
TYPES_FILE = Path(__file__).with_name("types.yaml")

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
    (r"^(n_group|topk_group|num_expert_group)$", 1),
    (r"intermediate_size", 32),                           # moe_/shared_expert_/... intermediate sizes
    (r"^(ffn_dim|ffn_hidden_size|n_inner|d_ff|decoder_ffn_dim|encoder_ffn_dim)$", 128),  # MLP widths by other names
    (r"^word_embed_proj_dim$", BASE_KWARGS["hidden_size"]),
    (r"^rotary_dim$", 8),                                 # partial rotary (codegen, gpt-j): half of head_dim 16
    (r"^(linear_num_heads|num_linear_heads)$", 4),        # linear-attention heads of head_dim 16
    (r"^(encoder|decoder)_attention_heads$", BASE_KWARGS["num_attention_heads"]),  # BART-likes, Whisper
    (r"(lora|laurel)_rank$", 16),
    (r"^num_dense_layers$", 1),                           # lfm2_moe: one dense layer, then sparse ones
    (r"^num_kv_shared_layers$", 0),
    (r"^(mamba_n_groups|mamba_ngroups)$", 2),             # two SSM groups: a gated norm's grouping is measurable                       # gemma3n: sharing would leave no layer that fills the cache
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
    (r"^(encoder|decoder)_layers$", 2),                   # BART-likes: the decoder their causal LM is
    (r"_layer_period$", 2),                               # jamba: attention / experts every other layer
    (r"_layer_offset$", 1),                               # ... starting at the second, so both kinds stay
    (r"^mm_tokens_per_image$", 4),                        # Gemma 3's pooling of the tiny tower's 4 x 4 patches to 2 x 2
)

#: Sizes of a sub-model beside the language model (vision tower, audio encoder, Q-Former): set where
#: its config has the key. Smaller than the language model's: such towers are wide (SigLIP: 1152).
SUB_BASE: dict[str, Any] = {
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "embed_dim": 32, "depth": 2, "num_heads": 2, "num_layers": 2, "vocab_size": 256,
}

#: Keys whose ``None`` default is a size the model needs anyway (hunyuan's head_dim, dots1's
#: expert counts): the size rule applies to them too. Other ``None`` keys mean "off" and stay.
_NONE_MEANS_UNSET = re.compile(r"head_dim$|experts$|experts_per_tok$")

#: List-valued keys: a new value given the number of layers.
LIST_RULES: dict[str, Callable[[list[Any], int], list[Any]]] = {
    "mlp_only_layers": lambda old, n: [0],                # one dense layer next to the sparse one
    "moe_layers": lambda old, n: list(range(1, n)),
    "no_rope_layers": lambda old, n: [1] * n,
    "full_attn_idxs": lambda old, n: [i for i in range(n) if i % 2 == 0],
    "attn_layer_indices": lambda old, n: [n - 1],         # hybrids (bamba): the last layer attends
    "hybrid_layer_ids": lambda old, n: [n - 1],
}

#: List keys that name one kind per layer: shrunk like ``layer_types`` (each distinct kind kept).
LAYER_PATTERN_KEYS = ("layer_types", "layers_block_type")


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
    config_class = CONFIG_MAPPING[model_type]
    try:
        defaults = config_class()
    except Exception:  # noqa: BLE001  (a default that does not validate: types.yaml's keys make it, gemma4_assistant)
        defaults = config_class(**type_overrides(model_type))
    overrides = tiny_overrides(defaults.to_dict(), special_ids_at_top=bool(_sub_config_names(config_class)))
    for name in _sub_config_names(config_class):
        sub = getattr(defaults, name, None)
        if sub is not None and hasattr(sub, "to_diff_dict"):
            overrides[name] = _sub_overrides(sub, language_model=name == "text_config")
    return merged(overrides, type_overrides(model_type))


def _sub_overrides(sub: Any, *, language_model: bool) -> dict[str, Any]:
    """The dict that builds a composite's sub-config, tiny: the composite's own values for it, shrunk.

    Why the composite's values and not the sub-config class's: a dict given for a sub-config is
    built on its class's defaults, which may not be the composite's (Aya Vision's SigLIP, DBRX's
    attention config with its rope), so the values the composite sets are written out, then shrunk.
    The language model gets :data:`engine.tiny.BASE_KWARGS` on top at build time; any other part
    (vision tower, audio encoder, Q-Former) :data:`SUB_BASE`, for the keys its config has.
    """
    own = {k: v for k, v in sub.to_diff_dict().items() if k not in _META_KEYS and not k.startswith("_")}
    values = sub.to_dict()
    if language_model:
        own = {k: v for k, v in own.items() if k not in BASE_KWARGS}
        return {**own, **tiny_overrides(values)}
    images = {}
    image, patch = values.get("image_size"), values.get("patch_size")
    if isinstance(image, int) and isinstance(patch, int) and 0 < 4 * patch < image:
        images["image_size"] = 4 * patch  # 4 x 4 patches: a checkpoint's 1540 px are 12,100 tokens to attend over
    # a part made of parts (DeepSeek-OCR 2's vision: a SAM tower and an encoder), each shrunk the same way
    nested = {name: _sub_overrides(part, language_model=False) for name in _sub_config_names(type(sub))
              if hasattr(part := getattr(sub, name, None), "to_diff_dict")}
    return {**own, **tiny_overrides(values), **{k: v for k, v in SUB_BASE.items() if k in values}, **images, **nested}


#: Config keys that describe a file, not a model: never written into a tiny config.
_META_KEYS = {"architectures", "auto_map", "transformers_version", "dtype", "torch_dtype", "output_attentions",
              "output_hidden_states", "return_dict", "id2label", "label2id"}


def generative_types() -> list[str]:
    """Every causal-LM and image-text-to-text model type of the installed transformers, sorted.

    The set a tiny model, the scaffold and docs/coverage.md answer for (transformers 5.25: 289).
    """
    from transformers.models.auto import modeling_auto

    return sorted(set(modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
                  | set(modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES))


def _sub_config_names(config_class: type) -> list[str]:
    return list(getattr(config_class, "sub_configs", None) or {})


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """``base`` updated by ``extra``, dicts merged key by key (a sub-config's overrides keep the derived ones)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def type_overrides(model_type: str) -> dict[str, Any]:
    """The keys ``types.yaml`` adds for ``model_type`` (what no size rule can derive), else ``{}``."""
    return dict(_type_table().get(model_type) or {})


@functools.cache
def _type_table() -> dict[str, Any]:
    import yaml

    data = yaml.safe_load(TYPES_FILE.read_text(encoding="utf-8")) or {}
    return {k: v for k, v in data.items() if isinstance(v, dict)}


def _size_rule(key: str) -> int | None:
    """The size :data:`SIZE_RULES` gives ``key`` (constants only), else None."""
    return next((new for pattern, new in SIZE_RULES if re.search(pattern, key) and isinstance(new, int)), None)


def _tiny_per_layer_config(per_layer: Any, layers: int) -> dict[str, Any] | None:
    """A ``per_layer_config`` (layer index -> keys that differ there) for the tiny layer count, else None.

    Why: Gemma 4 (global layers' head_dim) and dots3 (MLA sizes) override some layers by index;
    indices past the tiny model's layers are refused. The first overridden layer's keys go to the
    last tiny layer, their sizes shrunk as the rules say, so one layer still differs from the others.
    """
    if not isinstance(per_layer, dict) or not per_layer:
        return None
    first = min(per_layer, key=lambda k: int(k))
    values = dict(per_layer[first] or {})
    small = {k: BASE_KWARGS.get(k, _size_rule(k) or v) if isinstance(v, int) and not isinstance(v, bool) else v
             for k, v in values.items()}
    if values.get("num_key_value_heads") == values.get("num_attention_heads") and "num_key_value_heads" in values:
        small["num_key_value_heads"] = small.get("num_attention_heads", BASE_KWARGS["num_attention_heads"])
    return {str(layers - 1).zfill(len(str(first))): small}


def _per_layer_lists(defaults: dict[str, Any]) -> dict[str, list[Any]]:
    """List keys that hold one value per layer: ``layer_types`` and the like, and any list as long as the layer count."""
    count = defaults.get("num_hidden_layers")
    found = {}
    for key, value in defaults.items():
        if not isinstance(value, list) or not value or key in LIST_RULES:
            continue
        strings = all(isinstance(x, str) for x in value)
        if (key in LAYER_PATTERN_KEYS and strings) or (isinstance(count, int) and count > 2 and len(value) == count
                                                        and all(isinstance(x, (str, int, float)) for x in value)):
            found[key] = value
    return found


def _tiny_rope(defaults: dict[str, Any]) -> dict[str, Any] | None:
    """``rope_parameters`` with its multimodal sections (``mrope_section``) resized to the tiny head, else None.

    Why: Qwen-VL-style rope splits the rotary half-dimension into (time, height, width) sections that
    must sum to it; a tiny head of 16 (times ``partial_rotary_factor``) has a half of 8, so the default
    sections ([16, 24, 24]) are scaled to it, each kept at least 1 ([2, 3, 3]).
    """
    rope = defaults.get("rope_parameters")
    sections = rope.get("mrope_section") if isinstance(rope, dict) else None
    if not (isinstance(sections, list) and sections and all(isinstance(x, int) and x > 0 for x in sections)):
        return None
    factor = rope.get("partial_rotary_factor", defaults.get("partial_rotary_factor")) or 1.0
    half = max(len(sections), int(16 * float(factor)) // 2)
    scaled = [max(1, round(x * half / sum(sections))) for x in sections]
    while sum(scaled) != half:  # rounding: take from (or give to) the largest section
        i = scaled.index(max(scaled))
        scaled[i] += 1 if sum(scaled) < half else -1
    return {**rope, "mrope_section": scaled}


def tiny_overrides(defaults: dict[str, Any], *, special_ids_at_top: bool = False) -> dict[str, Any]:
    """The size overrides :func:`derive_tiny_config` applies, for any config's dict.

    Why separate: a checkpoint folder's config (its code maybe not in transformers, see
    :mod:`engine.scaffolding.source`) is shrunk by the same rules, from its own values.

    ``special_ids_at_top``: a composite's own token ids (image, video, audio) go to the top of the
    tiny vocabulary, so text-only probes (ids below every special one) never hold an image token.
    """
    overrides: dict[str, Any] = {}
    layers = BASE_KWARGS["num_hidden_layers"]
    per_layer = _per_layer_lists(defaults)
    kinds_of = {k: _distinct(v) for k, v in per_layer.items() if all(isinstance(x, str) for x in v)}
    layers = max([layers, *(len(kinds) for kinds in kinds_of.values())])
    if layers != BASE_KWARGS["num_hidden_layers"]:  # one layer of each kind
        overrides["num_hidden_layers"] = layers
    per_layer_config = _tiny_per_layer_config(defaults.get("per_layer_config"), layers)
    if per_layer_config is not None:
        overrides["per_layer_config"] = per_layer_config
    for key, values in per_layer.items():
        if key in kinds_of:  # one kind per layer: each distinct kind kept, the default's order (sliding before full)
            kinds = kinds_of[key]
            overrides[key] = [*kinds, *kinds][:layers] if len(kinds) < layers else kinds
        else:  # one number per layer: a size shrinks as the key's rule says (Gemma 3n's intermediate_size), else the first layers'
            size = BASE_KWARGS.get(key, _size_rule(key))
            overrides[key] = [size] * layers if isinstance(size, int) else (values * layers)[:layers]
    if isinstance(defaults.get("num_key_value_heads"), int) and defaults.get("num_key_value_heads") == defaults.get("num_attention_heads"):
        overrides["num_key_value_heads"] = BASE_KWARGS["num_attention_heads"]  # keep MHA (MLA needs it)
    rope = _tiny_rope(defaults)
    if rope is not None:
        overrides["rope_parameters"] = rope
    vocab = BASE_KWARGS["vocab_size"]
    next_id = iter(range(vocab - 1, -1, -1) if special_ids_at_top else range(vocab))
    for key, value in defaults.items():
        if key in BASE_KWARGS or key in overrides or isinstance(value, bool):
            continue
        if isinstance(value, list) and key in LIST_RULES:
            overrides[key] = LIST_RULES[key](value, layers)
        elif key.endswith(("_token_id", "_token_index")):
            ids = value if isinstance(value, list) else [value]
            if any(isinstance(i, int) and i >= vocab for i in ids):
                small = [next(next_id) for _ in ids]
                overrides[key] = small if isinstance(value, list) else small[0]
        elif value == 0 and key.endswith("head_dim"):
            continue  # a part the model does not have (GLM-5-Next's NoPE attention: qk_rope_head_dim 0) stays absent
        elif isinstance(value, int) or (value is None and _NONE_MEANS_UNSET.search(key)):
            for pattern, new in SIZE_RULES:
                if re.search(pattern, key):
                    target = new(key, value) if callable(new) else new
                    if target != value:
                        overrides[key] = target
                    break
    if isinstance(defaults.get("qk_head_dim"), int) and "qk_head_dim" in overrides:  # MLA: query head = nope + rope parts
        parts = [overrides.get(k, defaults.get(k)) for k in ("qk_nope_head_dim", "qk_rope_head_dim")]
        if all(isinstance(p, int) for p in parts):
            overrides["qk_head_dim"] = sum(parts)
    return overrides
