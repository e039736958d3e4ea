"""The tiny model that runs on token ids for a model type: the type's own, or its language model.

Why its own module: a generative type is a causal LM (``llama``) or an image-text-to-text model
(``mistral3``, ``gemma3n``, ``blip-2``). The scaffold measures what a text-only forward runs, so
a composite is measured whole where it builds and runs on token ids alone; where it does not
(its vision tower needs a package that is not installed, as Gemma 3n's needs ``timm``; or its
forward demands ``pixel_values``, as BLIP-2's), its language model is measured instead, built
from the composite's own ``text_config``, and the patchset says so. Its classes are the ones the
composite holds, so the declarations are the composite's too. The scaffold
(:mod:`engine.scaffolding`), ``patch-engine coverage`` and benchmarks/tiny_every_type.py all take
their model from here; coverage never counts a stand-in for its composite: it counts what
``engine.apply(model)`` does on the composite itself (:func:`engine.commands.coverage_measured.composite_entry`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["Subject", "tiny_subject"]


@dataclass
class Subject:
    """The model to measure and how to rebuild it."""

    model: nn.Module
    #: The ``tiny_model.config`` that rebuilds it from :attr:`tiny_type`.
    tiny_config: dict[str, Any]
    #: The model type the tiny model is built as: the requested one, or its language model's.
    tiny_type: str
    #: Why the language model stands in for the requested type ("" when it does not).
    note: str = ""


def _require_generative(model_type: str) -> None:
    """Refuse a type that is neither a causal LM nor an image-text-to-text model, saying what to do instead."""
    from transformers.models.auto import modeling_auto

    if model_type not in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and (
        model_type not in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES
    ):
        raise ValueError(
            f"model type {model_type!r} has no causal-LM or image-text-to-text class in transformers "
            "(AutoModelForCausalLM and AutoModelForImageTextToText do not map it: a text sub-config of a composite "
            "model, an encoder, ...); build a small model of it yourself and pass it: engine.scaffold(model)"
        )


def needs_pixels(model: nn.Module) -> bool:
    """Whether the model's forward cannot run on token ids alone (``pixel_values`` has no default)."""
    param = inspect.signature(model.forward).parameters.get("pixel_values")
    return param is not None and param.default is inspect.Parameter.empty


def tiny_subject(model_type: str, config: dict[str, Any] | None = None, *, seed: int = 0) -> Subject:
    """The tiny model of ``model_type`` the scaffold measures (see the module docstring).

    Raises ``ValueError`` naming the keys to pass when neither it nor its language model builds.
    """
    from engine.tiny import build_tiny_model
    from engine.tiny.config import derive_tiny_config, merged

    derived = derive_tiny_config(model_type)  # an unknown type is refused here, with the names it is close to
    _require_generative(model_type)
    tiny = merged(derived, config or {})
    from transformers import CONFIG_MAPPING

    part = language_part(CONFIG_MAPPING[model_type])
    composite = part is not None
    try:
        model = build_tiny_model(model_type, tiny, seed=seed, check_size=True)
    except Exception as exc:  # noqa: BLE001  (any config or build failure: the language model, or which keys to pass)
        if not composite:
            raise ValueError(
                f"could not build a tiny {model_type} model from the derived config {tiny}: {exc}. "
                "Pass the missing keys: engine.scaffold(model_type, config={...})"
            ) from exc
        why = (f"the composite does not build here ({type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
               f"{'; install it with the [vision] extra' if isinstance(exc, ImportError) else ''})")
        return _language_model(model_type, tiny, why, seed, part)
    if composite and needs_pixels(model):
        return _language_model(model_type, tiny, f"{type(model).__name__}.forward requires pixel_values", seed, part)
    if composite:
        failure = _text_only_failure(model)
        if failure:
            return _language_model(model_type, tiny, f"its forward fails on token ids alone ({failure})", seed, part)
    return Subject(model, tiny, model_type)


def language_part(config_class: type) -> str | None:
    """The sub-config a composite's language model is built from: its ``text_config``, the ``decoder``
    of a vision encoder-decoder, or the ``vlm_config`` of a vision-language-action model; None for a
    model of one part.

    Why the others: ``vision-encoder-decoder`` holds its language model (a causal LM: BERT's, GPT-2's)
    under ``decoder``, PI0 its PaliGemma under ``vlm_config`` (its action expert is a Gemma of the same
    classes), and their forwards need pixel_values (and actions), as a composite's does.
    """
    subs = getattr(config_class, "sub_configs", None) or {}
    return next((name for name in ("text_config", "decoder", "vlm_config") if name in subs), None)


def _text_only_failure(model: nn.Module) -> str:
    """Why one forward of token ids fails (Kosmos-2, IDEFICS: images required at run time), else ""."""
    import torch

    from engine.runtime.hub_functions import torch_path

    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    # below every special id the composite holds (its image token), as the verifier's probes are
    special = [v for k, v in vars(config).items() if k.endswith(("token_id", "token_index")) and isinstance(v, int)]
    vocab = min([int(text.vocab_size), *(v for v in special if v > 8)])
    ids = torch.randint(0, vocab, (1, 8), generator=torch.Generator().manual_seed(0))
    try:
        with torch.no_grad(), torch_path(model):
            model(input_ids=ids)
    except Exception as exc:  # noqa: BLE001  (whatever the composite raises without images)
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:160]}"
    return ""


def _language_model(model_type: str, tiny: dict[str, Any], why: str, seed: int, part: str = "text_config") -> Subject:
    from transformers import CONFIG_MAPPING

    from engine.tiny import build_tiny_model

    text = dict(tiny.get(part) or {})
    text_type = text.pop("model_type", None) or CONFIG_MAPPING[model_type]().get_text_config().model_type
    try:
        model = build_tiny_model(text_type, text, seed=seed, check_size=True)
    except Exception as exc:  # noqa: BLE001
        raise ValueError(
            f"could not build a tiny {model_type} model ({why}), nor its language model {text_type} from the "
            f"derived config {text}: {type(exc).__name__}: {exc}. Pass the missing keys: "
            "engine.scaffold(model_type, config={...})"
        ) from exc
    note = f"measured on its language model ({text_type}): {why}"
    return Subject(model, text, text_type, note)
