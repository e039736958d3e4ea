"""What the stacks claim where they are not importable: ``engine/_data/audit_stacks.yaml``, and model types of modules.

Why data: twinkle and LlamaFactory live in venvs of their own (their pins conflict with ours), so
the main venv cannot import them to ask; the file records what their installed packages map, and
the adapters read the package itself wherever it is importable.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from importlib import resources
from typing import Any

import yaml

__all__ = ["model_types_of_modules", "stack_data", "text_type"]


@functools.cache
def _data() -> dict[str, Any]:
    return yaml.safe_load(resources.files("engine").joinpath("_data", "audit_stacks.yaml").read_text(encoding="utf-8"))


def stack_data(stack: str) -> dict[str, Any]:
    return dict(_data()[stack])


def text_type(model_type: str) -> str:
    """The type whose tiny model an audit builds for a modeling module's type: its text model where we bundle one.

    Why: ``gemma3``'s modeling module holds ``Gemma3RMSNorm`` and ``Gemma3MLP``, which the text model
    ``gemma3_text`` is built from; a composite's tiny model would add a vision tower nothing maps.
    """
    from engine.auditing.adapters.patchset import bundled_by_type

    bundled = bundled_by_type()
    return f"{model_type}_text" if f"{model_type}_text" in bundled else model_type


def model_types_of_modules(modules: Iterable[str]) -> list[str]:
    """``transformers.models.X.modeling_X`` -> :func:`text_type` of ``X``, sorted, once each."""
    return sorted({text_type(m.split(".")[2]) for m in modules if m.startswith("transformers.models.")})
