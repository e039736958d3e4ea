"""The bundled patchset for a model's type, where there is one: what ``engine.apply(model)`` uses first.

Why the bundled file first: it was measured, read by a person and verified by CI on every
release of the matrix, so on a tested release it costs nothing extra. A model whose code is
not transformers' (``trust_remote_code``) never gets one: a class of the same name may compute
something else (the planner refuses it too), so its declarations are measured.
"""

from __future__ import annotations

import functools
import re

import yaml
from torch import nn

from engine.loader import bundled_dir, bundled_names

__all__ = ["bundled_for", "bundled_types"]

_MODEL_TYPES = re.compile(r"^model_types:\s*(\[.*\])\s*$", re.MULTILINE)
_EXTENDS = re.compile(r"^extends:", re.MULTILINE)
#: The package transformers imports ``trust_remote_code`` modeling files under.
_REMOTE_CODE = "transformers_modules."


@functools.lru_cache(maxsize=1)
def bundled_types() -> dict[str, str]:
    """``model_type -> bundled name``: the file named after the type, else the first base file listing it.

    Read from each file's ``model_types:`` line (no schema validation: a broken bundled file is
    the loader's tests' business, and it fails loudly when applied).
    """
    found: dict[str, tuple[int, str]] = {}
    for name in bundled_names():
        try:
            text = (bundled_dir() / f"{name}.yaml").read_text(encoding="utf-8")
            match = _MODEL_TYPES.search(text)
            types = yaml.safe_load(match.group(1)) if match else []
        except (OSError, yaml.YAMLError):
            continue
        rank = 1 if _EXTENDS.search(text) else 2  # a variant that extends a base (qwen3_flce) ranks after it
        for model_type in types if isinstance(types, list) else []:
            mine = (0 if name == model_type else rank, name)
            if model_type not in found or mine < found[model_type]:
                found[str(model_type)] = mine
    return {t: name for t, (_, name) in found.items()}


def bundled_for(model: nn.Module) -> str | None:
    """The bundled patchset name for ``model`` (its ``config.model_type``), or ``None``."""
    if any(type(m).__module__.startswith(_REMOTE_CODE) for m in model.modules()):
        return None
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return bundled_types().get(str(model_type)) if model_type else None
