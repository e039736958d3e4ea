"""Seeing through wrappers that hold a transformers model and delegate to it.

Why: peft's ``get_peft_model`` returns a ``PeftModel`` around the transformers model. If
the engine stored its patch state on the wrapper, the same model could be patched twice
(once through the wrapper, once directly), and ``engine.revert(peft.get_base_model())``
would find nothing to revert. So every public entry point (plan, apply, revert,
is_patched, verify) first unwraps to the transformers model, and the state always lives
there, whichever order the user wraps and patches in.

Detection is by duck type (a ``get_base_model()`` method returning another module), so
peft is never imported here.
"""

from __future__ import annotations

from torch import nn

__all__ = ["unwrap"]


def unwrap(model: nn.Module) -> nn.Module:
    """The innermost model behind ``get_base_model()`` wrappers (peft); ``model`` itself otherwise."""
    seen = 0
    while seen < 8:  # a wrapper of a wrapper is possible; a cycle is not followed forever
        get_base = getattr(type(model), "get_base_model", None)
        if not callable(get_base):
            return model
        inner = model.get_base_model()  # type: ignore[operator]
        if inner is model or not isinstance(inner, nn.Module):
            return model
        model = inner
        seen += 1
    return model
