"""What the scaffold measures against: the real inputs of every module and of every function the forwards call.

Why its own module: capture decides *which* functions count as a model's math, wherever
their code lives (transformers' modeling modules, a ``trust_remote_code`` checkpoint's
``transformers_modules.*``, a user's module), and reaches them through the same routers
function patches use (:mod:`engine.runtime.routing`), so what is measured is what can be patched.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine.runtime import routing
from engine.runtime.hub_functions import torch_body, torch_path
from engine.verification.compare import cast_floats

__all__ = ["capture", "model_functions"]

#: Packages whose functions are machinery, not a model's math: a forward's calls into them are not
#: measured (transformers' own ``transformers.models.*`` modeling code is, see :func:`_is_model_function`).
_LIBRARY_PACKAGES = frozenset({"torch", "transformers", "engine", "einops", "numpy", *sys.stdlib_module_names})


def _is_model_function(body: Any) -> bool:
    """Whether a function a forward calls is a model's own math, wherever its code lives.

    transformers' modeling modules, a remote-code checkpoint's ``transformers_modules.*``, a
    user's module: yes. torch, the standard library and transformers' machinery (masks,
    attention dispatch, decorators): no.
    """
    module = str(getattr(body, "__module__", "") or "")
    if module.startswith("transformers.models."):
        return True
    return bool(module) and module.split(".")[0] not in _LIBRARY_PACKAGES


def model_functions(model: nn.Module) -> dict[tuple[str, str], Callable[..., Any]]:
    """Module-level functions that the model's forwards name (see :func:`_is_model_function`)."""
    found: dict[tuple[str, str], Callable[..., Any]] = {}
    for cls in {type(m) for m in model.modules()}:
        forward = getattr(cls, "forward", None)
        for _ in range(16):
            if forward is None:
                break
            code = getattr(forward, "__code__", None)
            namespace = getattr(forward, "__globals__", {})
            module = sys.modules.get(str(namespace.get("__name__")))
            if module is None or vars(module) is not namespace:  # code run from a string: nowhere to route
                code = None
            for name in code.co_names if code is not None else ():
                value = namespace.get(name)
                body = torch_body(value) if callable(value) else None
                if inspect.isfunction(body) and _is_model_function(body):
                    found[(namespace["__name__"], name)] = value
            forward = getattr(forward, "__wrapped__", None)
    return found


def capture(model: nn.Module) -> tuple[dict[str, Any], dict[tuple[str, str], Any]]:
    """One forward (and a decode step): the first inputs of every module and of every named function.

    A composite's vision tower runs too (random images through its ``get_image_features``), so its
    modules and its copies of a function (mistral3: ``apply_rotary_pos_emb`` of ``modeling_mistral`` for
    the text, of ``modeling_pixtral`` for the images) are measured where they are called.

    Returns ``({module path: (args, kwargs)}, {(namespace, name): (function, (args, kwargs) or None)})``.
    """
    modules: dict[str, Any] = {}
    functions: dict[tuple[str, str], Any] = {}
    handles = []
    for path, module in model.named_modules():
        def hook(mod: nn.Module, args: Any, kwargs: Any, _path: str = path) -> None:
            modules.setdefault(_path, (cast_floats(args, torch.float32), cast_floats(kwargs, torch.float32)))

        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    named = model_functions(model)

    def observer_for(key: tuple[str, str]) -> Callable[[Any, Any], None]:
        def observe(args: Any, kwargs: Any) -> None:
            functions.setdefault(key, (cast_floats(args, torch.float32), cast_floats(kwargs, torch.float32)))

        return observe

    from engine.verification.probes import probe_batch, unlabelled

    batch = probe_batch(model, seq=16)
    ids = batch.get("input_ids")  # None: an encoder reading images only (Pix2Struct), no decode step on ids alone
    try:
        with routing.observing(named, observer_for), torch.no_grad(), torch_path(model):  # routed first, as before
            model(**unlabelled(model, batch))  # with GIT's inline images, an encoder-decoder's decoder ids
            try:  # prefill then one cached token: reaches functions only decode calls
                if ids is None:
                    raise ValueError("no token ids to decode")
                out = model(input_ids=ids[:, :-1], use_cache=True)
                if getattr(out, "past_key_values", None) is not None:
                    model(input_ids=ids[:, -1:], past_key_values=out.past_key_values, use_cache=True)
            except (TypeError, ValueError, NotImplementedError, RuntimeError):
                pass
            _vision_step(model)
    finally:
        for h in handles:
            h.remove()
    return modules, {key: (value, functions.get(key)) for key, value in named.items()}


def _vision_step(model: nn.Module) -> None:
    """Random images through a composite's vision tower (which token ids never reach); nothing without one.

    A tower that does not run on the tiny inputs leaves its modules and functions uncaptured, and the
    scaffold says each was never called, as for any other probe it cannot make.
    """
    from engine.tiny import image_features, tiny_vision_inputs

    inputs = tiny_vision_inputs(model)
    if inputs is None:
        return
    device = next(model.parameters()).device
    try:
        image_features(model, {k: v.to(device) for k, v in inputs.items()})
    except (TypeError, ValueError, AttributeError, NotImplementedError, RuntimeError):
        pass
