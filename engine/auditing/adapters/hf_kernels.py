"""``--with hf-kernels``: HF ``kernels``' ``kernelize(model, mode=TRAINING)`` with a mapping that resolves without the hub.

What transformers' ``use_kernels=True`` does, with one difference: the mapping's repositories.
transformers decorates its classes with ``@use_kernel_forward_from_hub(NAME)`` and maps each
``NAME`` to a layer of a hub repository; ``kernelize`` then replaces the forward of every decorated
module whose name the mapping has for the device and mode. Here the mapping names the same layer
(``RMSNorm`` -> ``LigerRMSNorm``, what transformers maps for training) but its repository is an
object of ``kernels``' own repository protocol (``load()`` returns the layer class) that loads
the layer from an installed package (:mod:`engine.auditing.adapters.hf_kernels_layers`), so
nothing is downloaded. The layer is registered for the model's device (``cpu`` here, where
transformers maps it for ``cuda``), and its Triton kernel runs under Triton's interpreter. Layer
names whose hub build has no local equivalent here (the rotary kernel) are left unmapped, and
the report says so.
"""

from __future__ import annotations

import functools
import importlib
import re
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from engine.auditing.adapters import Adapter, NotClaimed
from engine.auditing.adapters.liger import triton_on_cpu
from engine.auditing.adapters.stack_data import model_types_of_modules
from engine.errors import MissingDependency
from engine.foundation.versions import installed_version

__all__ = ["LOCAL_LAYERS", "InstalledLayer", "claims", "for_model_type"]

#: Layer name (as transformers decorates its classes) -> where the installed layer is.
LOCAL_LAYERS = {"RMSNorm": "engine.auditing.adapters.hf_kernels_layers:LigerRMSNorm"}


@dataclass(frozen=True)
class InstalledLayer:
    """A repository in ``kernels``' protocol (``load()`` -> the layer class) for a layer in an installed package."""

    spec: str

    @property
    def layer_name(self) -> str:
        return self.spec.rsplit(":", 1)[1]

    def load(self) -> type[nn.Module]:
        module, _, name = self.spec.partition(":")
        return getattr(importlib.import_module(module), name)


@functools.cache
def _decorated() -> dict[str, list[str]]:
    """Modeling module -> the layer names its classes are decorated with (read from the source, nothing imported)."""
    import transformers

    found: dict[str, list[str]] = {}
    pattern = re.compile(r'@use_kernel_forward_from_hub\("(\w+)"\)')
    for path in sorted((Path(transformers.__file__).parent / "models").glob("*/modeling_*.py")):
        names = pattern.findall(path.read_text(encoding="utf-8"))
        if names:
            found[f"transformers.models.{path.parent.name}.{path.stem}"] = sorted(set(names))
    return found


def claims() -> list[str]:
    """Model types whose modeling module decorates a class with a layer name the mapping resolves here."""
    modules = [m for m, names in _decorated().items() if set(names) & set(LOCAL_LAYERS)]
    return model_types_of_modules(modules)


def for_model_type(model_type: str) -> Adapter:
    try:
        import kernels  # noqa: F401
    except ImportError as exc:
        raise MissingDependency(f"--with hf-kernels needs the kernels package (pip install kernels): {exc}") from exc
    if model_type not in claims():
        raise NotClaimed(f"no class of model type {model_type!r} is decorated with a layer name the hf-kernels mapping "
                         f"resolves here ({', '.join(LOCAL_LAYERS)})")
    notes = [_NOTE]

    def apply(model: nn.Module) -> None:
        from kernels import Mode, kernelize, use_kernel_mapping

        names = {n for m in model.modules() if isinstance(n := getattr(type(m), "kernel_layer_name", None), str)}
        if names - set(LOCAL_LAYERS):
            notes.append(f"layer names this model's classes are decorated with that the mapping leaves out (no local "
                         f"build of their hub layers; they keep their forward): {', '.join(sorted(names - set(LOCAL_LAYERS)))}")
        device = next(model.parameters()).device.type
        mapping = {name: {device: InstalledLayer(spec)} for name, spec in LOCAL_LAYERS.items()}
        with use_kernel_mapping(mapping, inherit_mapping=False):
            kernelize(model, mode=Mode.TRAINING, device=device)

    return Adapter(f"hf-kernels {installed_version('kernels')}: kernelize(model, mode=TRAINING), RMSNorm -> LigerRMSNorm "
                   "(local)", apply, environment=triton_on_cpu, notes=notes, reading="Triton's interpreter")


_NOTE = ("the mapping's repository loads the layer transformers maps (kernels-community/liger-kernels LigerRMSNorm) "
         "from the installed liger-kernel instead of the hub; its Triton kernel ran under Triton's interpreter")
