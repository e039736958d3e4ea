"""Inputs for verification: a probe batch, and the inputs every patched module really receives.

Captured from one real forward of the model (and one cached decode step, for functions only
decoding reaches), so shapes, gates and dtypes are the ones the model really uses.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import re
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
    seq = axial_length(text, model) or seq
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    per_codebook = codebook_layout(model, text)
    if per_codebook is not None:  # ids and labels laid out by more than (batch, seq): MusicGen's codebooks
        return per_codebook(vocab, batch, seq, gen, device)
    ids = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    images: dict[str, torch.Tensor] = {}
    if text is not config:  # a composite that cannot run on token ids alone (BLIP-2): its images, query tokens
        from engine.tiny.vision_inputs import query_token_inputs

        found = query_token_inputs(model, ids, seed=seed)
        if found is not None:
            ids, images = found
        else:  # an image-to-text encoder-decoder (Pix2Struct, PP-FormulaNet): its encoder reads images only
            from engine.tiny.vision_inputs import encoder_images

            images = encoder_images(model, batch, seed=seed) or {}
    if not takes_labels(model):  # a base model (no LM head, e.g. Qwen2VLTextModel): no labels to give
        return {"input_ids": ids, **images}
    labels = ids.clone()
    labels[:, : ids.shape[1] - seq] = -100  # query tokens: the image's place, not text to predict
    made = {"input_ids": ids, "labels": labels, **images, **inline_images(model, batch=batch, seed=seed,
                                                                          seq=ids.shape[1])}
    if "input_ids" not in inspect.signature(model.forward).parameters and images:  # Pix2Struct: labels feed its decoder
        del made["input_ids"]
    return made


#: An input's documented shape in a transformers docstring: ``labels (`torch.LongTensor` of shape `(b, s, k)`...``.
_DOCUMENTED = re.compile(r"(\w+) \(`torch\.\w+` of shape `\(([^)]*)\)`")
#: The probe's own dimensions, by the names transformers' docstrings give them.
_PROBE_DIMS = {"batch_size": "batch", "sequence_length": "seq", "target_sequence_length": "seq"}


def codebook_layout(model: nn.Module, text: Any) -> Callable[..., dict[str, torch.Tensor]] | None:
    """How to draw ids and labels for a model whose labels have a dimension of the config's (None: (batch, seq)).

    Why: an audio decoder reads several codebooks per step (MusicGen: ids of ``(batch_size *
    num_codebooks, sequence_length)``, labels of ``(batch_size, sequence_length, num_codebooks)``,
    one loss per codebook); labels of (batch, seq) do not fit its loss. The layout is read from the
    forward's own documentation of ``input_ids`` and ``labels``, each dimension a product of the
    probe's sizes and integer sizes of the (text) config; the labels are the ids' tokens in their
    order (the same token at the same codebook and step), as a user's training batch holds them.
    None where the labels are documented as (batch, seq), not documented, or a dimension is
    neither the probe's nor the config's.
    """
    if not takes_labels(model):
        return None
    shapes = {name: [[f.strip() for f in dim.split("*")] for dim in shape.split(",")]
              for name, shape in _DOCUMENTED.findall(inspect.getdoc(model.forward) or "")}
    ids_dims, label_dims = shapes.get("input_ids"), shapes.get("labels")
    if ids_dims is None or label_dims is None or all(len(d) == 1 and d[0] in _PROBE_DIMS for d in label_dims):
        return None
    order = [f for dim in ids_dims for f in dim]
    if sorted(order) != sorted(f for dim in label_dims for f in dim) or len(set(order)) != len(order):
        return None  # labels not the ids' tokens rearranged: not a layout this probe draws
    config_sizes = {f: getattr(text, f, None) for f in order if f not in _PROBE_DIMS}
    if any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in config_sizes.values()):
        return None

    def draw(vocab: int, batch: int, seq: int, gen: torch.Generator, device: torch.device) -> dict[str, torch.Tensor]:
        sizes = {**{k: {"batch": batch, "seq": seq}[v] for k, v in _PROBE_DIMS.items()}, **config_sizes}
        tokens = torch.randint(0, vocab, [sizes[f] for f in order], generator=gen).to(device)
        flat = [f for dim in label_dims for f in dim]
        labels = tokens.permute(*(order.index(f) for f in flat)).contiguous()
        ids = tokens.reshape([math.prod(sizes[f] for f in dim) for dim in ids_dims])
        labels = labels.reshape([math.prod(sizes[f] for f in dim) for dim in label_dims])
        return {"input_ids": ids, "labels": labels}

    return draw


def axial_length(text: Any, model: nn.Module) -> int | None:
    """The one sequence length a model with axial position embeddings trains on (their factors' product), else None.

    Why: Reformer's axial position embeddings are a grid of ``axial_pos_shape`` factors, and in training
    its forward takes only a sequence that fills the grid (``make sure that config.axial_pos_shape factors
    ... multiply to sequence length``); read off the config as its forward reads it.
    """
    shape = getattr(text, "axial_pos_shape", None)
    if not model.training or not getattr(text, "axial_pos_embds", False) or not isinstance(shape, (list, tuple)):
        return None
    return math.prod(int(f) for f in shape) if shape and all(isinstance(f, int) for f in shape) else None


def inline_images(model: nn.Module, *, batch: int, seed: int, seq: int | None = None) -> dict[str, torch.Tensor]:
    """``batch`` random images for a captioning causal LM whose text decoder reads them inline, else nothing.

    Why: such a model (GIT: one config, its ``vision_config`` beside the decoder's keys, no text
    sub-config) puts the image's tokens before the text in one sequence, and its loss scores the
    logits after ``image_patch_tokens`` positions whether or not images came: on token ids alone
    the scored slice is empty (``Expected input batch_size (0) to match target batch_size``) or
    misaligned. With the images it trains as it is used, and the vision tower is in the
    whole-model check too. A composite model (a text sub-config) is probed on text alone.

    A decoder that cross-attends to its images (IDEFICS: its forward takes ``image_attention_mask``,
    which text position sees which image) reads them per sample, ``(batch, images, C, H, W)``: one
    image each, seen from every position of the ``seq`` tokens.
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
    pixels = torch.cat([im["pixel_values"] for im in images]).to(device)
    if "image_attention_mask" in inspect.signature(model.forward).parameters and seq is not None:
        return {"pixel_values": pixels.unsqueeze(1), "image_attention_mask": torch.ones(
            batch, seq, 1, dtype=torch.long, device=device)}
    return {"pixel_values": pixels}


def unlabelled(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``batch`` for a forward without labels: an encoder-decoder's decoder then reads the batch's token ids.

    Why: an encoder-decoder (T5Gemma 2, UDOP) makes its decoder's ids from the labels (shifted right
    inside its forward); without labels and without ``decoder_input_ids`` its decoder has no input
    (``You must specify exactly one of input_ids or inputs_embeds``) and no module is reached.
    """
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    ids = batch.get("input_ids", batch.get("labels"))  # no input_ids (Pix2Struct): the tokens are the labels
    takes = inspect.signature(model.forward).parameters
    if "decoder_input_ids" in takes and "decoder_input_ids" not in inputs and isinstance(ids, torch.Tensor):
        inputs["decoder_input_ids"] = ids
    return inputs


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
        model(**unlabelled(model, batch))
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
