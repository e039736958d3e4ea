"""Tiny transformers models built from a config alone, with weights perturbed away from init.

Why perturb: a fresh norm weight is all ones (or all zeros for ``1 + w`` norms), where
``w`` and ``1 + w`` or two cast orders can coincide; a test on fresh weights proves little.
Every parameter is moved by a random amount *away* from its init value (never landing on
exactly 0 or 1), so norm weights end up around 1 for ``weight`` norms and around 0 for
``one_plus_weight`` norms, as in trained models.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from engine.errors import InvalidArgument, PatchsetError, VersionMismatch
from engine.runtime.release import bundled_covering, check_release
from engine.tiny.construction import own_construction
from engine.tiny.vision_inputs import image_features, tiny_vision_inputs, vision_only_inputs

__all__ = [
    "build_tiny_for",
    "build_tiny_model",
    "check_tiny_config",
    "image_features",
    "is_composite",
    "perturb_",
    "tiny_config_kwargs",
    "tiny_vision_inputs",
    "vision_only_inputs",
]

#: Config keys that count or size something: a tiny model needs them positive.
_POSITIVE = re.compile(r"^num_\w*(layers|heads|experts)$|_size$|_dim$|^max_position_embeddings$")
#: Counts of optional parts, where 0 means none (the scaffold writes 0 multi-token-prediction layers,
#: and 0 KV-sharing layers for Gemma 3n: every tiny layer fills its own cache).
_MAY_BE_ZERO = {"num_nextn_predict_layers", "num_kv_shared_layers"}

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
    """:data:`BASE_KWARGS` updated by ``overrides``; a base key set to ``None`` there is not passed at all.

    Why ``None`` drops a base key: a few config classes compute one from their own keys and refuse
    it as an argument (ProphetNet's ``num_hidden_layers`` is its encoder's layer count; XLNet's
    ``max_position_embeddings`` is unlimited), so their types.yaml entry (or a ``tiny_model.config``)
    writes ``num_hidden_layers: null`` and the class's own value stands.
    """
    kwargs = {**BASE_KWARGS, **(overrides or {})}
    return {k: v for k, v in kwargs.items() if not (k in BASE_KWARGS and v is None)}


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


def _composite_kwargs(config_class: type, overrides: dict[str, Any]) -> dict[str, Any]:
    """Keyword arguments of a composite config: the tiny base sizes go to ``text_config``.

    Why: a composite model (Qwen2-VL, LLaVA, PaliGemma, Gemma 3, ...) takes its language
    model's sizes under ``text_config`` and its vision tower's under ``vision_config``; the
    base sizes are for a language model, so they apply to ``text_config`` only, and a
    patchset's ``tiny_model.config`` gives the vision tower's sizes itself.
    """
    kwargs = dict(overrides)
    kwargs["text_config"] = tiny_config_kwargs(overrides.get("text_config"))
    return kwargs


def is_composite(config_class: type) -> bool:
    """Whether configs of this class hold a ``text_config`` (a multimodal composite model)."""
    return "text_config" in (getattr(config_class, "sub_configs", None) or {})


def _transformers_classes(model_type: str, composite: bool) -> tuple[Any, Any]:
    """transformers' own config and model classes for ``model_type``.

    Why not the Auto classes: a package may register its own model under a transformers model
    type (flash-linear-attention registers its Mamba2 as ``mamba2`` when imported), and the
    Auto mappings then build that one. The static name tables name transformers' classes.
    """
    import transformers
    from transformers.models.auto import configuration_auto, modeling_auto

    config_name = configuration_auto.CONFIG_MAPPING_NAMES.get(model_type)
    # a text sub-model type without a causal LM class (qwen2_vl_text): its base model, no LM head
    tables = [modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, modeling_auto.MODEL_MAPPING_NAMES]
    if composite:
        tables.insert(0, modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    else:  # in no other table: vision-encoder-decoder (its decoder is its language model, see engine.tiny.subject)
        tables.append(modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)
    model_name = next((t[model_type] for t in tables if model_type in t), None)
    config_cls = getattr(transformers, config_name, None) if config_name else None
    model_cls = getattr(transformers, model_name, None) if isinstance(model_name, str) else None
    if model_cls is None and config_cls is not None:
        model_cls = _causal_lm_of_config(config_cls)
    if config_cls is None or model_cls is None:  # a type registered from outside transformers
        from transformers import AutoConfig, AutoModelForCausalLM

        return AutoConfig.for_model(model_type).__class__, AutoModelForCausalLM
    return config_cls, model_cls


def _causal_lm_of_config(config_cls: type) -> Any:
    """The class of ``config_cls``'s own modeling module that takes it: its ``*ForCausalLM``, else its
    LM-head model, else its text model; None where it has none.

    Why: some text sub-model types are in no Auto table (``mllama_text_model``), yet their
    package has a causal LM for exactly that config (``MllamaForCausalLM``), or a decoder with an
    LM head by another name (``BlipTextLMHeadModel``; ``Pix2StructTextModel``, whose text model is
    its decoder), or a text model only (``Granite4VisionTextModel``: hidden states out, no LM head).
    """
    import importlib

    module_name = config_cls.__module__.replace(".configuration_", ".modeling_")
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return None
    order = ("ForCausalLM", "LMHeadModel", "TextModel")
    takers = [(n, c) for n, c in vars(module).items()
              if isinstance(c, type) and getattr(c, "config_class", None) is config_cls]
    return next((c for end in order for n, c in takers if n.endswith(end)), None)


def build_tiny_model(
    model_type: str,
    config: dict[str, Any] | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    perturb: bool = True,
    attn_implementation: str | None = "eager",
    random_buffers: Mapping[str, int | str] | None = None,
    check_size: bool | None = None,
) -> nn.Module:
    """A causal LM of ``model_type`` with the tiny base sizes plus ``config`` overrides.

    Without ``config``, the type's derived tiny config (:func:`engine.tiny.config.derive_tiny_config`):
    every causal-LM and image-text-to-text type of transformers builds so (benchmarks/tiny_every_type.py).

    A type with no causal LM class in transformers (a text sub-model such as ``qwen2_vl_text``)
    gets its base model (``Qwen2VLTextModel``: hidden states out, no LM head).

    For a composite (multimodal) type the whole model is built (language model and vision
    tower): the base sizes go to ``text_config``, and ``config`` may give ``text_config`` and
    ``vision_config`` dicts.

    ``random_buffers``: a patchset's ``tiny_model.random_buffers`` (:func:`fill_random_buffers`).
    ``check_size``: count the parameters on the meta device first and refuse over
    :data:`MAX_TINY_PARAMETERS` (default: for a derived config, where the size rules may miss a key).
    """
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    derived = config is None
    check_size = derived if check_size is None else check_size
    if derived:  # the type's own tiny config: its defaults shrunk by rule, plus engine/tiny/types.yaml
        from engine.tiny.config import derive_tiny_config

        config = derive_tiny_config(model_type)
    with own_construction("cpu"):  # not on the meta device of a model being built around it
        torch.manual_seed(seed)
        composite = is_composite(CONFIG_MAPPING[model_type])
        config_cls, model_cls = _transformers_classes(model_type, composite)
        kwargs = _composite_kwargs(config_cls, config or {}) if composite else tiny_config_kwargs(config)
        cfg = _config_the_model_takes(model_cls, config_cls(**kwargs))
        if attn_implementation is not None:
            cfg._attn_implementation = attn_implementation
            for name in getattr(type(cfg), "sub_configs", None) or {}:
                sub = getattr(cfg, name, None)
                if sub is not None and hasattr(sub, "_attn_implementation"):
                    sub._attn_implementation = attn_implementation
        if check_size:  # rules met a config they do not know: refuse before allocating (deepseek_ocr2's 22 GB)
            _refuse_large(model_type, model_cls, cfg)
        model = model_cls._from_config(cfg) if hasattr(model_cls, "_from_config") else model_cls.from_config(cfg)
        if perturb:
            perturb_(model, seed=seed)
        if random_buffers:
            fill_random_buffers(model, random_buffers, seed=seed)
        return model.to(dtype)


def _config_the_model_takes(model_cls: Any, cfg: Any) -> Any:
    """``cfg``, or its sub-config that ``model_cls`` is built from where the type's config is a whole of parts.

    Why: MusicGen's causal LM is its decoder: ``MusicgenForCausalLM`` takes the ``MusicgenDecoderConfig``
    the ``musicgen`` config holds under ``decoder``, and built from the whole it fails on a key only the
    decoder has.
    """
    wanted = getattr(model_cls, "config_class", None)
    if not isinstance(wanted, type) or isinstance(cfg, wanted):
        return cfg
    parts = (getattr(cfg, name, None) for name in getattr(type(cfg), "sub_configs", None) or {})
    return next((part for part in parts if isinstance(part, wanted)), cfg)


#: A tiny model of a derived config larger than this means the size rules missed the config's own size keys.
MAX_TINY_PARAMETERS = 50_000_000


def _refuse_large(model_type: str, model_cls: Any, cfg: Any) -> None:
    """Count the model's parameters on the meta device; refuse one the size rules did not shrink."""
    with torch.device("meta"):
        shape = model_cls._from_config(cfg) if hasattr(model_cls, "_from_config") else model_cls.from_config(cfg)
    count = sum(p.numel() for p in shape.parameters())
    if count > MAX_TINY_PARAMETERS:
        raise InvalidArgument(
            f"the tiny {model_type} model built from its derived config would have {count / 1e6:.0f}M parameters: "
            "the size rules (engine/tiny/config.py) do not know some of its size keys. Give them in "
            f"engine/tiny/types.yaml, or pass a config: build_tiny_model({model_type!r}, {{...}})"
        )


def fill_random_buffers(model: nn.Module, bounds: Mapping[str, int | str], *, seed: int = 0) -> None:
    """Fill each integer buffer named in ``bounds`` with seeded random values in ``[0, bound)``, distinct along its last dim where they fit.

    Why: a table a checkpoint fills (DeepSeek-V4's hash router ``tid2eid``, token -> experts) is
    all zeros in a model built from a config, so every token goes to expert 0 and a check of
    that routing compares zeros with zeros. A bound is an int or the name of a config attribute
    (``n_routed_experts``), looked up on the buffer's own config-bearing model first.

    Raises:
        InvalidArgument: a name matches no integer buffer, or a bound is neither a positive int
            nor a config attribute holding one.
    """
    gen = torch.Generator().manual_seed(seed)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name, bound in bounds.items():
        high = getattr(config, bound, None) if isinstance(bound, str) else bound
        if not isinstance(high, int) or isinstance(high, bool) or high < 1:
            raise InvalidArgument(
                f"tiny_model.random_buffers.{name}: the bound {bound!r} is not a positive int nor a config attribute "
                f"holding one ({type(model.config).__name__}.{bound} = {high!r}); give an int or an attribute name")
        found = [(path, buf) for path, buf in model.named_buffers()
                 if path.rsplit(".", 1)[-1] == name and not buf.is_floating_point()]
        if not found:
            integer = sorted({p.rsplit(".", 1)[-1] for p, b in model.named_buffers() if not b.is_floating_point()})
            raise InvalidArgument(
                f"tiny_model.random_buffers.{name}: {type(model).__name__} has no integer buffer named {name!r}; "
                f"its integer buffers: {', '.join(integer) or 'none'}")
        with torch.no_grad():
            for _, buf in found:
                if buf.dim() >= 1 and buf.shape[-1] <= high:  # distinct values along the last dim (a token's experts)
                    draw = torch.rand((*buf.shape[:-1], high), generator=gen).argsort(dim=-1)[..., :buf.shape[-1]]
                else:
                    draw = torch.randint(0, high, buf.shape, generator=gen)
                buf.copy_(draw.to(buf.dtype))


def _patchset_file(patchset: Any) -> str | None:
    """The file a patchset was loaded from, when it came from exactly one."""
    files = {origin[0] for origin in getattr(patchset, "_origins", {}).values() if origin[0]}
    return files.pop() if len(files) == 1 else None


def check_tiny_config(model_type: str, config: dict[str, Any], *, file: str | None = None) -> None:
    """Refuse a ``tiny_model`` that cannot build a model, before transformers fails with a traceback.

    Checks the model type exists, every value has the type of the config's default (an int
    where transformers expects an int), and counts and sizes are positive. Raises
    :class:`PatchsetError` keyed ``tiny_model.config.<key>``, or :class:`InvalidArgument` for
    an unknown model type (:class:`VersionMismatch` when a bundled patchset covers it on other releases).
    """
    from transformers import CONFIG_MAPPING, AutoConfig

    if model_type not in CONFIG_MAPPING:
        import difflib

        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING.keys()), n=3)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise bundled_covering(model_type) or InvalidArgument(
            f"unknown model type {model_type!r} (not a transformers config model_type){hint}"
        )
    defaults = AutoConfig.for_model(model_type)
    for key, value in config.items():
        where = f"tiny_model.config.{key}"
        if value is None and key in BASE_KWARGS:  # a base size the class computes itself (tiny_config_kwargs)
            continue
        try:
            default = getattr(defaults, key, None)
        except Exception:  # a per-layer attribute (Gemma 4's head_dim) refuses global reads: no default to check
            default = None
        kinds = (bool,) if isinstance(default, bool) else (int,) if isinstance(default, int) else (
            (int, float) if isinstance(default, float) else None
        )
        if kinds and (not isinstance(value, kinds) or (bool not in kinds and isinstance(value, bool))):
            expected = " or ".join(k.__name__ for k in kinds)
            raise PatchsetError(
                f"{value!r} is a {type(value).__name__}, but {model_type} configs take an {expected} here "
                f"(default {default!r}); write it without quotes", file=file, key=where,
            )
        if isinstance(value, int) and not isinstance(value, bool) and _POSITIVE.search(key) and value <= 0 and not (
            value == 0 and key in _MAY_BE_ZERO
        ):
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
    outside = check_release(patchset, mt)  # the version refusal comes before anything is built
    config = dict(tiny.config) if tiny else {}
    file = _patchset_file(patchset)
    try:
        check_tiny_config(mt, config, file=file)
    except InvalidArgument as exc:  # the file's own tiny_model.model_type: a key of the file, not an argument
        if not (tiny and tiny.model_type == mt):
            raise
        raise PatchsetError(str(exc), file=file, key="tiny_model.model_type") from None
    from engine.tiny.budget import check_tiny_budget  # a config over the budget is refused before anything is built

    check_tiny_budget(mt, config, file=file)
    try:
        model = build_tiny_model(mt, config, dtype=dtype, seed=seed, random_buffers=tiny.random_buffers if tiny else None)
        from engine.runtime.hub_functions import torch_path

        # values that build but do not fit (heads vs kv heads) fail here; inputs on the CPU, whatever device context
        with torch.no_grad(), torch_path(model), own_construction("cpu"):
            model(**(vision_only_inputs(model, batch=1) or {"input_ids": torch.zeros(1, 4, dtype=torch.long)}))
    except InvalidArgument as exc:  # our own, from tiny_model.random_buffers: it names its key
        raise PatchsetError(str(exc), file=file, key="tiny_model.random_buffers") from exc
    except Exception as exc:  # whatever transformers' config, model __init__ or forward raises for these values
        if outside is not None:  # a release the patchset is not verified on: that is the likelier cause
            raise VersionMismatch(
                f"{outside}, and its tiny {mt} model cannot be built on {outside.installed} ({type(exc).__name__}: "
                f"{str(exc).strip()}), so nothing can verify it there; nothing was patched. Install a transformers "
                f"in {outside.spec} (docs/compatibility.md)"
            ) from exc
        raise PatchsetError(
            f"building a tiny {mt} model from it failed: {type(exc).__name__}: {str(exc).strip()}. "
            f"Fix the values (keyword arguments of AutoConfig.for_model({mt!r}))", file=file, key="tiny_model.config",
        ) from exc
    return model
