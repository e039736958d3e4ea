"""What a self-verification verdict depends on, as data: its key material and the key hashed from it.

Why each part: a verdict says "this patchset, with these kernels, computes what the original
computes on a model of this type, on this release". It changes with the patchset's resolved
content (``extends`` included, the fused head's settings included), the model type it was
verified on (the user's: a patchset for ``[qwen3, llama]`` verified on a llama says nothing of
its Qwen3 patches), the engine's own code (ops, kernels, the verifier), the libraries whose code
runs (transformers, torch, the vendor kernels), the device kind (another GPU compiles Triton
kernels for another architecture; the Triton interpreter is not a GPU), the dtype and the mode
(``auto`` picks kernels by them; the judge runs in them), and the kernel each patch got.
Anything else (the model's size, its weights, the machine's name) does not enter: the
verification runs on a tiny model of the user's model type.

The material is stored in each entry and compared on read, so a key collision or a hand-edited
entry can never pass for another verification.
"""

from __future__ import annotations

import functools
import hashlib
import json
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

__all__ = ["LIBRARIES", "device_kind", "engine_fingerprint", "key_material", "key_of", "library_versions",
           "model_code"]

#: Distributions whose code a verdict depends on (absent ones are recorded as absent).
LIBRARIES = ("transformers", "torch", "liger-kernel", "flash-linear-attention", "fla-core", "triton", "torch-npu",
             "kernels")


@functools.lru_cache(maxsize=1)
def library_versions() -> tuple[tuple[str, str | None], ...]:
    """``(distribution, version or None)`` of :data:`LIBRARIES`, read once per process."""
    found = []
    for name in LIBRARIES:
        if name == "torch":  # with its local label: a CUDA build (+cu130) and the CPU wheel (+cpu) differ
            found.append((name, torch.__version__))
            continue
        try:
            found.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            found.append((name, None))
    return tuple(found)


@functools.lru_cache(maxsize=1)
def engine_fingerprint() -> str:
    """A hash of the engine's own code and data tables (every ``.py`` and ``.yaml`` of the package but the bundled patchsets).

    The bundled patchsets are left out because a verdict keys on its own patchset's content.
    """
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.suffix in (".py", ".yaml") and "_bundled" not in path.parts and "__pycache__" not in path.parts:
            digest.update(path.relative_to(root).as_posix().encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def device_kind(device: str, *, interpreted: bool = False, index: int | None = None) -> str:
    """The kind of device a verification ran on: ``cpu``, ``cuda NVIDIA H200 (sm_90)``, ``cuda (Triton interpreter)``."""
    if device == "cuda" and interpreted:
        return "cuda (Triton interpreter on the CPU)"
    if device == "cuda" and torch.cuda.is_available():
        at = index if index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(at)
        return f"cuda {torch.cuda.get_device_name(at)} (sm_{major}{minor})"
    module = getattr(torch, device, None)
    name = getattr(module, "get_device_name", None)
    if device != "cpu" and callable(name):
        try:
            return f"{device} {name()}"
        except Exception:  # noqa: BLE001  (a backend without names: the type is the kind)
            return device
    return device


def key_material(
    patchset: Any, *, device_kind: str, dtype: str, mode: str, kernels: dict[str, list[str]],
    versions: dict[str, str | None] | None = None, model_type: str | None = None,
) -> dict[str, Any]:
    """Everything the verdict depends on, as JSON-ready data (``versions`` defaults to the installed ones).

    ``model_type``: the type of the model the verdict is for (the user's ``config.model_type``).
    """
    from engine.verification.conditions import selection_key

    content = json.dumps(patchset.model_dump(mode="json"), sort_keys=True)
    return {
        "patchset": patchset.name,
        "patchset_sha256": hashlib.sha256(content.encode()).hexdigest(),
        "model_type": model_type,
        "engine": engine_fingerprint(),
        "libraries": dict(library_versions()) if versions is None else dict(versions),
        "device": device_kind,
        "dtype": dtype,
        "mode": mode,
        "kernels": {str(k): sorted(v) for k, v in sorted(kernels.items(), key=lambda kv: int(kv[0]))},
        # the conditions of use the verification runs (the budget's, or what $PATCH_ENGINE_CONDITIONS names): a
        # verdict reached without a condition is not one reached with it
        "conditions": selection_key("budget"),
    }


def model_code(model: Any) -> str | None:
    """The sha256 of the file that defines ``type(model)`` where it is a checkpoint's own code (remote code), else ``None``.

    Why: transformers' own classes are keyed by its version; a checkpoint's modeling file is not
    versioned with anything, so its content enters the key (another revision: another verdict).
    """
    import inspect

    cls = type(model)
    if not cls.__module__.startswith("transformers_modules."):
        return None
    try:
        source = inspect.getsourcefile(cls)
        return hashlib.sha256(Path(source).read_bytes()).hexdigest() if source else "unknown"
    except (OSError, TypeError):
        return "unknown"


def key_of(material: dict[str, Any]) -> str:
    """The file name of a verdict: ``<patchset>-<32 hex digits of the material's sha256>``."""
    digest = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in str(material.get("patchset", "")))[:40]
    return f"{safe or 'patchset'}-{digest}"
