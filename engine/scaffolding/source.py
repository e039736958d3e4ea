"""The model the scaffold measures when it is given a local checkpoint folder.

Why a folder: a model whose code is not in transformers (a ``trust_remote_code``
checkpoint, whose ``config.json`` maps its own ``configuration_*.py`` and ``modeling_*.py``
with ``auto_map``) has no ``model_type`` transformers knows, so ``patch-engine scaffold
MODEL_TYPE`` cannot build it. ``patch-engine scaffold --model FOLDER`` loads it the way a
user does (``AutoConfig`` / ``AutoModelForCausalLM``), and by default shrinks its config by
the same size rules as :func:`engine.tiny.config.derive_tiny_config` and perturbs the weights:
the scaffold measures code, and a tiny copy of the code is enough (``weights=True`` measures
the checkpoint as saved instead, for small ones).

Running a folder's own code is the user's decision: without ``trust_remote_code`` a folder
that needs it is refused, naming the files that would run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.errors import InvalidArgument, shown_path

__all__ = ["is_folder", "model_from_folder", "transformers_code"]

#: A tiny model larger than this means the size rules missed the config's own size keys.
MAX_TINY_PARAMETERS = 50_000_000
#: Config keys that describe the file, not the model (never written into ``tiny_model.config``).
_META_KEYS = {"architectures", "auto_map", "transformers_version", "model_type", "dtype", "torch_dtype",
              "_name_or_path", "output_attentions", "output_hidden_states", "return_dict"}


def is_folder(model_or_type: Any) -> bool:
    """Whether the scaffold's argument names a checkpoint folder rather than a model type.

    A ``Path`` always does; a string does when it is an existing folder and no transformers
    model type (a type wins: ``llama`` is the type even beside a folder named ``llama``).
    """
    if isinstance(model_or_type, os.PathLike):
        return True
    if isinstance(model_or_type, str) and os.path.isdir(model_or_type):
        from transformers import CONFIG_MAPPING

        return model_or_type not in CONFIG_MAPPING
    return False


def transformers_code(model: nn.Module) -> bool:
    """Whether every class of the model is transformers' (or torch's), so its ``model_type`` rebuilds it."""
    return all(type(m).__module__.startswith(("transformers.", "torch.")) for m in model.modules())


def _remote_code_files(auto_map: dict[str, Any]) -> list[str]:
    refs = [r for v in auto_map.values() for r in (v if isinstance(v, list) else [v]) if isinstance(r, str)]
    # "module.Class", or "repo--module.Class" for code that lives in another repository
    return sorted({r.split("--")[-1].rsplit(".", 1)[0] + ".py" for r in refs})


def _read_config_json(path: Path) -> dict[str, Any]:
    if not path.is_dir():
        raise InvalidArgument(f"--model {shown_path(path)}: no such folder (it takes a local checkpoint folder)")
    file = path / "config.json"
    if not file.is_file():
        raise InvalidArgument(
            f"--model {shown_path(path)}: the folder has no config.json; it takes a checkpoint folder as "
            "save_pretrained writes it (a hub repository must be downloaded first, e.g. with `hf download`)"
        )
    try:
        return dict(json.loads(file.read_text()))
    except (ValueError, TypeError) as exc:
        raise InvalidArgument(f"{file} is not a JSON object: {exc}") from exc


def model_from_folder(
    folder: str | os.PathLike[str],
    *,
    trust_remote_code: bool = False,
    weights: bool = False,
    config: dict[str, Any] | None = None,
    seed: int = 0,
) -> tuple[nn.Module, dict[str, Any] | None]:
    """The model to measure, and the ``tiny_model.config`` that rebuilds it (``None`` when none can).

    Raises :class:`InvalidArgument` (a usage error) for a missing folder or config, for remote
    code without ``trust_remote_code``, and for a config the size rules cannot shrink.
    """
    from transformers import CONFIG_MAPPING, AutoConfig, AutoModelForCausalLM

    from engine.tiny import BASE_KWARGS, perturb_
    from engine.tiny.config import tiny_overrides

    path = Path(folder)
    raw = _read_config_json(path)
    auto_map = raw.get("auto_map") or {}
    if auto_map and not trust_remote_code and raw.get("model_type") not in CONFIG_MAPPING:
        raise InvalidArgument(
            f"{shown_path(path)} holds its own model code: config.json maps "
            + ", ".join(f"{k} -> {v}" for k, v in auto_map.items())
            + f" (auto_map), so loading it runs {', '.join(_remote_code_files(auto_map))} from that folder. "
            "Read that code, then pass --trust-remote-code (engine.scaffold(path, trust_remote_code=True))"
        )
    try:
        cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as exc:  # noqa: BLE001  (whatever the folder's config or code raises: say where)
        raise InvalidArgument(f"could not load the config of {shown_path(path)}: {type(exc).__name__}: {exc}") from exc
    if weights:
        model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=trust_remote_code, dtype=torch.float32)
        return model, None
    values = cfg.to_dict()
    sizes = {k: v for k, v in {**BASE_KWARGS, **tiny_overrides(values)}.items() if k in values}
    cfg = type(cfg).from_dict({**values, **sizes, **(config or {})})
    _refuse_large(path, cfg, trust_remote_code)
    torch.manual_seed(seed)
    try:
        model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code, attn_implementation="eager")
    except Exception as exc:  # noqa: BLE001
        raise InvalidArgument(
            f"could not build a tiny model from {shown_path(path)}'s config with the sizes {sizes}: "
            f"{type(exc).__name__}: {exc}. "
            "Pass the keys that fit with --config '{...}' (engine.scaffold(path, config={...})), or --weights to "
            "measure the checkpoint as saved"
        ) from exc
    model = perturb_(model.float(), seed=seed)
    tiny = None
    if transformers_code(model):  # the bundled tooling rebuilds it from model_type plus these keys
        diff = cfg.to_diff_dict()
        tiny = {k: v for k, v in diff.items() if k not in _META_KEYS and not k.startswith("_")}
        tiny = {k: v for k, v in tiny.items() if BASE_KWARGS.get(k, object()) != v}
    return model, tiny


def _refuse_large(path: Path, cfg: Any, trust_remote_code: bool) -> None:
    """Count the tiny model's parameters on the meta device, before allocating any."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            shape = AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)
    except Exception:  # noqa: BLE001  (building for real reports the failure with its fix)
        return
    count = sum(p.numel() for p in shape.parameters())
    if count > MAX_TINY_PARAMETERS:
        ints = sorted(k for k, v in cfg.to_dict().items() if isinstance(v, int) and not isinstance(v, bool) and v > 64)
        raise InvalidArgument(
            f"the tiny model built from {shown_path(path)}'s config would still have {count / 1e6:.0f}M parameters: "
            f"the size rules do not know its size keys. Pass small values with --config '{{...}}' (its int keys "
            f"over 64: {', '.join(ints)}), or --weights to measure the checkpoint as saved"
        )
