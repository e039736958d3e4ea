"""Inputs for verification: a probe batch, and the inputs every patched module really receives.

Captured from one real forward of the model (and one cached decode step, for functions only
decoding reaches), so shapes, gates and dtypes are the ones the model really uses.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map_only

from engine.runtime import routing
from engine.verification.compare import clone_tensors, move_tensors


def probe_batch(model: nn.Module, *, batch: int = 2, seq: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """A deterministic random batch of token ids (with labels where the model takes them).

    A vision-only model gets ``batch`` random images instead (see :func:`engine.tiny.vision_only_inputs`).

    For a composite (multimodal) model the ids come from its text config's vocabulary, below
    every special multimodal token id, so the batch is text only (the vision tower is probed
    separately with pixels, see :func:`_vision_step`), unless its forward requires images (the
    BLIP family: :func:`engine.tiny.vision_inputs.query_token_inputs`), which the batch then holds.
    """
    from engine.tiny import vision_only_inputs

    pixels = vision_only_inputs(model, batch=batch, seed=seed)
    if pixels is not None:  # a vision-only model (PixtralVisionModel): images, no token ids
        return pixels
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(text.vocab_size)
    if text is not config:  # image/video token ids live on the composite config
        special = [v for k, v in vars(config).items() if k.endswith(("token_id", "token_index")) and isinstance(v, int)]
        vocab = min([vocab, *(v for v in special if v > 8)])
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    images: dict[str, torch.Tensor] = {}
    if text is not config:  # a composite that cannot run on token ids alone (BLIP-2): its images, query tokens
        from engine.tiny.vision_inputs import query_token_inputs

        found = query_token_inputs(model, ids, seed=seed)
        if found is not None:
            ids, images = found
    if not takes_labels(model):  # a base model (no LM head, e.g. Qwen2VLTextModel): no labels to give
        return {"input_ids": ids, **images}
    labels = ids.clone()
    labels[:, : ids.shape[1] - seq] = -100  # query tokens: the image's place, not text to predict
    return {"input_ids": ids, "labels": labels, **images, **inline_images(model, batch=batch, seed=seed)}


def inline_images(model: nn.Module, *, batch: int, seed: int) -> dict[str, torch.Tensor]:
    """``batch`` random images for a captioning causal LM whose text decoder reads them inline, else nothing.

    Why: such a model (GIT: one config, its ``vision_config`` beside the decoder's keys, no text
    sub-config) puts the image's tokens before the text in one sequence, and its loss scores the
    logits after ``image_patch_tokens`` positions whether or not images came: on token ids alone
    the scored slice is empty (``Expected input batch_size (0) to match target batch_size``) or
    misaligned. With the images it trains as it is used, and the vision tower is in the
    whole-model check too. A composite model (a text sub-config) is probed on text alone.
    """
    from engine.tiny import tiny_vision_inputs

    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config or getattr(config, "vision_config", None) is None:
        return {}
    if "pixel_values" not in inspect.signature(model.forward).parameters:
        return {}
    images = [tiny_vision_inputs(model, seed=seed + i) for i in range(batch)]
    if any(im is None or set(im) != {"pixel_values"} or im["pixel_values"].dim() != 4 for im in images):
        return {}  # a tower of another input convention: not one this probe knows how to draw
    device = next(model.parameters()).device
    return {"pixel_values": torch.cat([im["pixel_values"] for im in images]).to(device)}


def takes_labels(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes ``labels`` (a model with an LM head) or not (a base model)."""
    return "labels" in inspect.signature(model.forward).parameters


def capture_inputs(
    model: nn.Module, decisions: Sequence[Any], batch: dict[str, torch.Tensor], held: torch.device | None = None
) -> dict[str, Any]:
    """Run one forward and record the first inputs of every patched module and function (on ``held``).

    ``held``: where the recorded inputs wait for their check (the host, for a model on an
    accelerator: with ``modules="all"`` they are one activation per patched module).
    """
    captured: dict[str, Any] = {}
    with recording(model, decisions, captured, held), torch.no_grad():
        model(**{k: v for k, v in batch.items() if k != "labels"})
        if any(d.path not in captured for d in decisions):
            _vision_step(model)
        if any(d.path not in captured for d in decisions):
            _decode_step(model, batch)
    return captured


@contextlib.contextmanager
def recording(
    model: nn.Module, decisions: Sequence[Any], into: dict[str, Any], held: torch.device | None = None,
    inputs: bool = True,
) -> Iterator[dict[str, Any]]:
    """While the block runs, the first inputs each patched module and function of ``decisions`` receives go into ``into``.

    Why a block and not a forward of its own: verification records the modules' inputs during
    the original's run of the whole-model check (a forward it makes anyway), which saves a
    forward of the model. Inputs are detached and put on ``held`` (in their own dtype); a
    ``labels`` keyword is left out (the capturing forward runs without labels, and a module
    check compares outputs, not a loss). ``inputs=False``: only that each was called (``True``), nothing copied.
    """
    modules = dict(model.named_modules())
    handles = []
    observers: list[tuple[routing.FunctionRouter, Callable[..., None]]] = []
    for d in decisions:
        if d.site is None:

            def hook(module: nn.Module, args: Any, kwargs: Any, _path: str = d.path) -> None:
                if _path not in into:
                    into[_path] = _record(args, {k: v for k, v in kwargs.items() if k != "labels"}, held) if inputs else True

            handles.append(modules[d.path].register_forward_pre_hook(hook, with_kwargs=True))
        else:
            router = routing.router_for(d.site.namespace, d.site.function)
            if router is None:
                continue

            def observe(args: Any, kwargs: Any, _path: str = d.path) -> None:
                if _path not in into:  # copies: the kernel called next may work in place (liger's rope)
                    into[_path] = _record(clone_tensors(args), clone_tensors(kwargs), held) if inputs else True

            router.observers.append(observe)
            observers.append((router, observe))
    try:
        yield into
    finally:
        for h in handles:
            h.remove()
        for router, observe in observers:
            router.observers.remove(observe)


def _record(args: Any, kwargs: Any, held: torch.device | None) -> tuple[Any, Any]:
    """The inputs detached, in their own dtype, on ``held``.

    Why not cast to fp32 here: each check casts them to the dtypes it runs (fp32 and the
    model's low precision), which is exact from a bf16 input either way; recorded during the
    original's run, an fp32 copy of every bf16 input would sit on top of that training step.
    """
    return move_tensors(_detached(args), held), move_tensors(_detached(kwargs), held)


def _detached(value: Any) -> Any:
    return tree_map_only(torch.Tensor, torch.Tensor.detach, value)


def _vision_step(model: nn.Module) -> None:
    """Random pixels through a composite model's ``get_image_features``: reaches the vision tower,
    which a text-only probe never calls. A model without one is left alone."""
    from engine.tiny import image_features, tiny_vision_inputs

    inputs = tiny_vision_inputs(model)
    if inputs is None:
        return
    try:
        image_features(model, inputs)
    except (TypeError, ValueError, AttributeError, NotImplementedError):
        return  # patches it leaves uncaptured are reported as never called


def _decode_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> None:
    """Prefill, then one cached token: reaches functions only decode calls (a recurrent kernel).

    A model that cannot decode this way simply leaves those functions uncaptured, and the
    verification reports them as never called.
    """
    ids = batch.get("input_ids")
    if ids is None or ids.shape[-1] < 2:
        return
    try:
        out = model(input_ids=ids[:, :-1], use_cache=True)
        cache = getattr(out, "past_key_values", None)
        if cache is not None:
            model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
    except (TypeError, ValueError, NotImplementedError):
        return


def low_precision_dtype(model: nn.Module) -> torch.dtype:
    dtype = next(model.parameters()).dtype
    return dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
