"""Which sub-model of a composite model a module belongs to (``model.visual``, ``model.language_model``).

Why: one patchset covers a multimodal model's language model and its vision tower, and the
plan must show which of the two each decision is about. A sub-model is a nested
``PreTrainedModel`` (transformers builds each tower as one); a module belongs to the
innermost one that contains it. Found from the model's structure, not from names, so no
family needs its own rule.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["sub_model_of", "sub_model_paths"]


def sub_model_paths(model: nn.Module) -> tuple[str, ...]:
    """Paths of the nested pretrained models under ``model`` (the root excluded), deepest first."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return ()
    paths = [path for path, module in model.named_modules() if path and isinstance(module, PreTrainedModel)]
    return tuple(sorted(paths, key=lambda p: -p.count(".")))


def sub_model_of(path: str, paths: Iterable[str]) -> str:
    """The innermost sub-model path containing module ``path``; ``""`` for the root model itself."""
    for root in paths:
        if path == root or path.startswith(root + "."):
            return root
    return ""
