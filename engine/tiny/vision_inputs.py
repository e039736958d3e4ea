"""Random image inputs for a tiny model's vision tower, and the tower's output.

Why a module of its own: the verifier, the scaffold and the tiny-model sweep all feed a composite's
vision tower; what an image looks like is read off each tower's config, by convention (flattened
Qwen-VL patches with their grid, square images, tiles), and has nothing to do with building models.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["encoder_images", "image_features", "query_token_inputs", "tiny_vision_inputs", "vision_only_inputs"]

#: Frames of a video for a Q-Former video model. InstructBLIP-Video's processor gives 4; each frame runs the
#: same modules, and 4 x 32 query tokens would pass a tiny copy's 128 positions (shrunk by the size rules).
VIDEO_FRAMES = 1


def vision_only_inputs(model: nn.Module, *, batch: int = 2, seed: int = 0) -> dict[str, torch.Tensor] | None:
    """Random images for a vision-only model (``forward(pixel_values, ...)``, no ``input_ids``), else None.

    Why: a vision tower on its own (PixtralVisionModel) takes no token ids; its images are
    ``(batch, num_channels, image_size, image_size)`` read off its config, with ``image_sizes``
    (every image full size) where its forward takes them. Two images exercise how the model
    joins several images (Pixtral: one sequence with a block-diagonal attention mask).
    """
    import inspect

    params = inspect.signature(model.forward).parameters
    if "input_ids" in params or "pixel_values" not in params:
        return None
    config = model.config
    size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
    channels = int(getattr(config, "num_channels", 3))
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    pixels = torch.randn(batch, channels, size, size, generator=gen).to(device, next(model.parameters()).dtype)
    inputs = {"pixel_values": pixels}
    if "image_sizes" in params:
        inputs["image_sizes"] = torch.tensor([[size, size]] * batch, device=device)
    return inputs


def tiny_vision_inputs(model: nn.Module, *, seed: int = 0) -> dict[str, torch.Tensor] | None:
    """Random pixel inputs for a composite model's ``get_image_features``, or None without a vision tower.

    Two conventions exist, read off ``vision_config``: Qwen-VL towers take flattened patches
    ``(patches, channels * temporal_patch_size * patch_size**2)`` with ``image_grid_thw``
    (one image of 2 x 2 merged patches here); the others (SigLIP, CLIP, InternViT) take
    ``(1, channels, image_size, image_size)``, tiled ones (mllama: ``max_num_tiles``) one
    image of one tile with its aspect-ratio inputs. A tower of none of these kinds gets None.
    """
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    if vision is None:
        return None
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    if hasattr(vision, "temporal_patch_size") or _takes_grid(model):  # HunYuan-VL 4: no temporal patches (1)
        merge = int(getattr(vision, "spatial_merge_size", getattr(vision, "merge_size", 1)))  # Muse Glimmer: merge_size
        channels = int(getattr(vision, "in_channels", getattr(vision, "in_chans", getattr(vision, "num_channels", 3))))
        side = 2 * merge
        temporal = getattr(vision, "temporal_patch_size", getattr(vision, "patch_temporal", 1))  # Muse Glimmer: patch_temporal
        width = channels * int(temporal) * int(vision.patch_size) ** 2
        pixels = torch.randn(side * side, width, generator=gen)
        return {"pixel_values": pixels.to(dtype), "image_grid_thw": torch.tensor([[1, side, side]])}
    image_size = getattr(vision, "image_size", None)
    if image_size is None:  # a tower that takes other inputs (e.g. patches with 2-D position ids)
        return None
    size = image_size if isinstance(image_size, int) else image_size[0]
    channels = int(getattr(vision, "num_channels", 3))
    tiles = getattr(vision, "max_num_tiles", None)
    if isinstance(tiles, int):  # tiled images (mllama): one image of one tile, aspect ratio 1x1
        pixels = torch.randn(1, 1, tiles, channels, size, size, generator=gen).to(dtype)
        mask = torch.zeros(1, 1, tiles, dtype=torch.long)
        mask[..., 0] = 1
        return {"pixel_values": pixels, "aspect_ratio_ids": torch.ones(1, 1, dtype=torch.long),
                "aspect_ratio_mask": mask}
    pixels = torch.randn(1, channels, size, size, generator=gen).to(dtype)
    if getattr(vision, "model_type", None) == "pixtral":  # Mistral 3: its tower reads each image's size
        return {"pixel_values": pixels, "image_sizes": torch.tensor([[size, size]])}
    return {"pixel_values": pixels}


def _takes_grid(model: nn.Module) -> bool:
    """Whether the composite's ``get_image_features`` takes ``image_grid_thw``: flattened patches, as Qwen-VL's.

    Why: a tower of that convention need not name ``temporal_patch_size`` (HunYuan-VL 4's takes
    ``(patches, channels * patch_size**2)``, one frame per patch) nor an ``image_size``.
    """
    import inspect

    owner = model if hasattr(model, "get_image_features") else getattr(model, "model", model)
    method = getattr(owner, "get_image_features", None)
    return method is not None and "image_grid_thw" in inspect.signature(method).parameters


def image_features(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The vision tower's output for ``inputs`` (from :func:`tiny_vision_inputs`), as one tensor.

    Calls the composite model's own ``get_image_features`` (on the model, or on its inner
    ``model``), so the tower runs exactly as in a multimodal forward; without one (mllama),
    its ``vision_model``.
    """
    owner = model if hasattr(model, "get_image_features") else getattr(model, "model", model)
    if hasattr(owner, "get_image_features"):
        try:
            out = owner.get_image_features(**inputs)
        except ValueError:  # images grouped per sample (Idefics3, SmolVLM): (batch, images, C, H, W)
            pixels = inputs.get("pixel_values")
            if pixels is None or pixels.dim() != 4:
                raise
            out = owner.get_image_features(**{**inputs, "pixel_values": pixels.unsqueeze(1)})
    else:  # a composite without the helper (mllama): its vision model directly
        out = owner.vision_model(**inputs)
    feats = getattr(out, "pooler_output", None)
    if feats is None:
        feats = getattr(out, "last_hidden_state", out)
    if isinstance(feats, (list, tuple)):
        feats = torch.cat([f.reshape(-1) for f in feats])
    return feats


def query_token_inputs(
    model: nn.Module, ids: torch.Tensor, *, seed: int = 0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]] | None:
    """``(ids, other inputs)`` for a composite whose forward requires images (BLIP family, Kosmos-2); else None.

    Why: BLIP, BLIP-2, InstructBLIP, InstructBLIP-Video and Kosmos-2 cannot run on token ids alone, so a text
    probe reached none of their modules and ``engine.apply(model)`` patched nothing (issue 47). Their
    convention, read off the config and the forward: one random image per sample (a video of
    :data:`VIDEO_FRAMES` frames where the config names a video token and no image token); where
    the config has ``num_query_tokens``, the ids prefixed with that many image (video) tokens per image
    (frame), where the model puts the Q-Former's outputs; random ``qformer_input_ids`` where the forward
    takes them (InstructBLIP's instruction to its Q-Former). Kosmos-2's ``latent_query_num`` image
    embeddings go where ``image_embeds_position_mask`` says. A composite of another convention (a tower
    this module draws no images for, query tokens without a token id to put them at) gets None.
    """
    import inspect

    params = inspect.signature(model.forward).parameters
    pixels_param = params.get("pixel_values")
    masked = "image_embeds_position_mask" in params  # Kosmos-2: pixel_values defaults to None, yet is required
    if pixels_param is None or (pixels_param.default is not inspect.Parameter.empty and not masked):
        return None
    batch = ids.shape[0]
    images = [tiny_vision_inputs(model, seed=seed + i) for i in range(batch)]
    if any(im is None or set(im) != {"pixel_values"} or im["pixel_values"].dim() != 4 for im in images):
        return None
    pixels = torch.cat([im["pixel_values"] for im in images])
    config = model.config
    if masked:  # Kosmos-2: latent_query_num image embeddings at the positions its mask marks (here first)
        latent = int(config.latent_query_num)
        ids = torch.cat([ids[:, :1].expand(-1, latent), ids], dim=1)
        mask = torch.zeros_like(ids)
        mask[:, :latent] = 1
        return ids, {"pixel_values": pixels.to(ids.device), "image_embeds_position_mask": mask}
    queries = getattr(config, "num_query_tokens", None)
    if isinstance(queries, int):
        image, video = _token_id(config, "image"), _token_id(config, "video")
        if image is None and video is None:
            return None
        frames = 1 if image is not None else VIDEO_FRAMES
        if image is None:  # (batch, frames, channels, height, width)
            pixels = pixels.unsqueeze(1).expand(-1, frames, -1, -1, -1).contiguous()
        token = image if image is not None else video
        ids = torch.cat([ids.new_full((batch, queries * frames), token), ids], dim=1)
    inputs = {"pixel_values": pixels.to(ids.device)}
    if "qformer_input_ids" in params:
        vocab = int(getattr(getattr(config, "qformer_config", None), "vocab_size", 0) or 0) or 100
        gen = torch.Generator().manual_seed(seed)
        qformer_ids = torch.randint(3, max(4, min(vocab, 200)), (batch, 8), generator=gen)
        inputs["qformer_input_ids"] = qformer_ids.to(ids.device)
    return ids, inputs


def encoder_images(model: nn.Module, batch: int, *, seed: int = 0) -> dict[str, torch.Tensor] | None:
    """Images for an image-to-text encoder-decoder, whose encoder reads images only; else None.

    Why: Pix2Struct (its encoder reads ``flattened_patches``: each patch's row and column index, then its pixels)
    and PP-FormulaNet (``pixel_values``; its forward raises without them) cannot run on token ids, so a text probe
    reached none of their modules and ``engine.apply(model)`` patched nothing (issue 47). Their decoder reads the
    probe's token ids (PP-FormulaNet's ``input_ids``, shifted inside) or its labels (Pix2Struct, which takes no
    ``input_ids``). Such a model is an encoder-decoder whose config holds a ``vision_config`` (a text encoder
    beside it, Florence-2, has ``get_image_features`` and runs on text); 16 patches (a 4 x 4 grid) each, or one
    image of the vision config's size.
    """
    import inspect

    config = model.config
    vision = getattr(config, "vision_config", None)
    if not getattr(config, "is_encoder_decoder", False) or vision is None or hasattr(model, "get_image_features"):
        return None
    params = inspect.signature(model.forward).parameters
    parameter = next(model.parameters())
    gen = torch.Generator().manual_seed(seed)
    if "flattened_patches" in params and isinstance(getattr(vision, "patch_embed_hidden_size", None), int):
        side = 4
        index = torch.arange(side * side)
        grid = torch.stack([index // side, index % side], dim=-1).float().expand(batch, -1, -1)
        pixels = torch.randn(batch, side * side, int(vision.patch_embed_hidden_size), generator=gen)
        patches = torch.cat([grid, pixels], dim=-1).to(parameter.device, parameter.dtype)
        return {"flattened_patches": patches, "attention_mask": torch.ones(batch, side * side, device=parameter.device)}
    if "pixel_values" in params:
        size = getattr(vision, "image_size", None)
        height, width = (size, size) if isinstance(size, int) else tuple(size or (0, 0))[:2]
        if not height or not width:
            return None
        channels = int(getattr(vision, "num_channels", 3) or 3)
        pixels = torch.randn(batch, channels, int(height), int(width), generator=gen)
        return {"pixel_values": pixels.to(parameter.device, parameter.dtype)}
    return None


def _token_id(config: object, kind: str) -> int | None:
    """The config's ``image`` or ``video`` token id (``*_token_id`` or ``*_token_index``), if it sets one."""
    for name in (f"{kind}_token_id", f"{kind}_token_index"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None
