"""A local ``trust_remote_code`` checkpoint folder, written by the test that uses it (no hub access).

The folder holds what a hub repository with custom code holds: ``config.json`` whose
``auto_map`` names the config and model classes in ``configuration_toyllama.py`` and
``modeling_toyllama.py`` (copied from tests/remote_code/), and ``model.safetensors`` with
weights perturbed away from their init values (norm weights near 0, as ``1 + w`` norms are
trained), so a wrong declaration is visible in the numbers.

transformers copies remote code into ``HF_MODULES_CACHE`` and imports it as
``transformers_modules.<folder name>.modeling_toyllama``; :func:`isolated_modules_cache` points
that cache at a temporary folder and removes the imported modules afterwards, so nothing
leaks into the user's cache or into other tests.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

SOURCES = Path(__file__).resolve().parent / "remote_code"
MODEL_TYPE = "toyllama"


@contextlib.contextmanager
def isolated_modules_cache(root: Path) -> Iterator[Path]:
    """``HF_HOME`` and the dynamic-module cache in ``root``, offline; imported remote modules dropped after."""
    import transformers.dynamic_module_utils as dynamic
    from transformers.utils import hub

    cache = root / "modules"
    before = set(sys.modules)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HOME", str(root / "hf_home"))
        mp.setenv("HF_MODULES_CACHE", str(cache))
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(dynamic, "HF_MODULES_CACHE", str(cache))  # read once at import: the env alone is too late
        mp.setattr(hub, "HF_MODULES_CACHE", str(cache))
        mp.setattr(sys, "path", list(sys.path))  # transformers appends the cache to sys.path
        try:
            yield cache
        finally:
            for name in set(sys.modules) - before:
                if name == "transformers_modules" or name.startswith("transformers_modules."):
                    del sys.modules[name]


def write_checkpoint(
    folder: Path, *, seed: int = 0, model_type: str = MODEL_TYPE, renames: dict[str, str] | None = None
) -> Path:
    """Write the remote-code checkpoint into ``folder`` (created); returns it.

    The weights are saved from a model the remote code itself built, then perturbed.
    ``model_type`` and ``renames`` (text replaced in the code) make a checkpoint whose own code
    reuses transformers' names (``llama``, ``{"ToyRMSNorm": "LlamaRMSNorm"}``).
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.tiny import perturb_

    folder.mkdir(parents=True, exist_ok=True)
    renames = {f'model_type = "{MODEL_TYPE}"': f'model_type = "{model_type}"', **(renames or {})}

    def renamed(text: str) -> str:
        for old, new in renames.items():
            text = text.replace(old, new)
        return text

    for source in SOURCES.glob("*_toyllama.py"):
        (folder / source.name).write_text(renamed(source.read_text()))
    config = {
        "model_type": model_type,
        "architectures": ["ToyLlamaForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_toyllama.ToyLlamaConfig",
            "AutoModelForCausalLM": "modeling_toyllama.ToyLlamaForCausalLM",
        },
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    cfg = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    torch.manual_seed(seed)
    model = perturb_(AutoModelForCausalLM.from_config(cfg, trust_remote_code=True), seed=seed)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def load_checkpoint(folder: Path):  # type: ignore[no-untyped-def]
    """The checkpoint as a user loads it: ``from_pretrained(..., trust_remote_code=True)``, fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32)
