"""Random image inputs for a tiny model's vision tower, and the tower's output.

Why a module of its own: the verifier, the scaffold and the tiny-model sweep all feed a composite's
vision tower; what an image looks like is read off each tower's config, by convention (flattened
Qwen-VL patches with their grid, square images, tiles), and has nothing to do with building models.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["image_features", "tiny_vision_inputs", "vision_only_inputs"]


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
