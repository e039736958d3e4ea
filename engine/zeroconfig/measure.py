"""Declarations measured on a tiny copy of a model, as an in-memory patchset, cached by what they depend on.

The measurement is the scaffold's (:func:`engine.scaffolding.scaffold`: every declaration of
every op tried on every module class and module-level function, kept only when it is bit-exact
in fp32 and bf16 and no other is), run on :func:`engine.zeroconfig.tiny_copy.tiny_copy` of
the user's model. The result is data, like a user's file: the rendered YAML, loaded by the
same loader. It is cached on disk (beside the verdicts, :func:`engine.releases.cache_dir`)
keyed by the classes' code, the shrunk config, the engine's code and the libraries' releases,
so a training script measures once per release; what it measured is still verified (the
verdict has its own key, :mod:`engine.zeroconfig.verdict`).
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

import yaml
from torch import nn

from engine.errors import InvalidArgument, PatchError
from engine.loader import load_patchset
from engine.releases import VerdictStore, cache_dir
from engine.releases.key import engine_fingerprint, library_versions
from engine.scaffolding import scaffold
from engine.schema import Patchset
from engine.tiny.construction import callers_random_state
from engine.zeroconfig.tiny_copy import NO_PROBE_INPUTS, code_identity, tiny_copy

__all__ = ["Measured", "measure", "measurement_material"]

#: Lines of the rendered patchset that say what was not patched, and why.
_NOT_PATCHED = ("# not patched: ", "# tie, not patched: ", "# opt-in, not added: ")


@dataclass
class Measured:
    """What the measurement found for one model: the patchset (every exact declaration) and the rest."""

    patchset: Patchset | None  # None: nothing could be measured (``problem`` says why)
    text: str  # the rendered patchset, with its comments ("" when nothing was measured)
    not_patched: list[str] = field(default_factory=list)  # "OlmoLayerNorm (5 modules): why"
    problem: str = ""  # why no measurement ran (the tiny copy could not be built, ...)
    seconds: float = 0.0
    cached: bool = False
    cache_file: str | None = None


#: This process's measurements by key: a training script that applies again (a callback's second
#: event, each model of an ensemble) reads neither the file nor the YAML again.
_MEMO: dict[tuple[str, str], Measured] = {}


def measurement_material(model: nn.Module, identity: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything a measurement depends on, as data (stored in its cache entry and compared on read)."""
    return {"measured": 1, **(identity or code_identity(model)), "engine": engine_fingerprint(),
            "libraries": dict(library_versions())}


def _store() -> VerdictStore:
    """The verdict store's hardened files (private folder, no symlinks, size cap, lock), under ``measured/``."""
    return VerdictStore(cache_dir() / "measured")


def _data(text: str, model_type: str) -> dict[str, Any]:
    """The patchset the rendered text holds, as the data apply uses (renamed: it is not the scaffold's file)."""
    data = yaml.safe_load(text)
    data.pop("tiny_model", None)  # verified on the tiny copy of the user's model, not one rebuilt from a type name
    data["name"] = f"{data.get('name') or 'model'}.measured"
    data["description"] = f"Declarations measured on a tiny copy of this {model_type} model (engine.apply(model))."
    for patch in data.get("patches") or []:
        # the tiny copy's layers may hold a class the model lacks (a dense layer beside the experts): planned as a
        # skip and reported, not refused
        patch["optional"] = True
    return data


def _from_text(text: str, data: dict[str, Any]) -> Measured:
    lines = [line.removeprefix(p) for line in text.splitlines() for p in _NOT_PATCHED if line.startswith(p)]
    return Measured(load_patchset(data), text, not_patched=lines)


def _hit(found: Measured, start: float, path: str) -> Measured:
    return replace(found, cached=True, cache_file=path, seconds=round(time.perf_counter() - start, 3),
                   not_patched=list(found.not_patched))


def measure(model: nn.Module, identity: dict[str, Any] | None = None) -> Measured:
    """Measure ``model``'s declarations on a tiny copy of it (or read them from the cache).

    Never raises for a model it cannot measure: the returned :class:`Measured` has no patchset
    and says why (the caller reports it, and patches nothing). ``identity``: the model's
    :func:`~engine.zeroconfig.tiny_copy.code_identity`, where the caller has it already.
    """
    start = time.perf_counter()
    model_type = str(getattr(getattr(model, "config", None), "model_type", "") or type(model).__name__)
    try:
        material = measurement_material(model, identity)
    except Exception as exc:  # noqa: BLE001  (a config that cannot be shrunk: reported, nothing measured)
        return Measured(None, "", problem=f"its config cannot be shrunk to a tiny copy: {type(exc).__name__}: {exc}")
    key = f"{model_type[:40]}-{hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:32]}"
    key = "".join(c if c.isalnum() or c in "-_" else "_" for c in key)
    store = _store()
    memo = (str(store.folder), key)  # per cache folder: a hit names a file that is there
    if memo in _MEMO:
        return _hit(_MEMO[memo], start, str(store.path(key)))
    with store.lock(key):
        entry = store.read(key, material)
        if entry is not None and isinstance(entry.get("text"), str) and isinstance(entry.get("data"), dict):
            try:
                found: Measured | None = _from_text(entry["text"], entry["data"])
            except PatchError:
                found = None  # an entry this engine cannot load: measure again
            if found is not None:
                _MEMO[memo] = found
                return _hit(found, start, str(store.path(key)))
        try:
            # the tiny copy's own warnings are not the user's, and the user's random state is left as it was
            with warnings.catch_warnings(), callers_random_state("cpu"):
                warnings.simplefilter("ignore")
                tiny = tiny_copy(model)
                text = scaffold(tiny).to_yaml()
        except Exception as exc:  # noqa: BLE001  (whatever stops the measurement is reported, not raised)
            what = (f"{type(model).__name__} cannot be measured on a tiny copy: "  # the model's inputs, in plain words
                    if isinstance(exc, InvalidArgument) and NO_PROBE_INPUTS in str(exc)
                    else f"measuring a tiny copy of {type(model).__name__} failed: {type(exc).__name__}: ")
            return Measured(None, "", problem=f"{what}{str(exc).strip()[:500]}",
                            seconds=round(time.perf_counter() - start, 3))
        data = _data(text, model_type)
        found = _from_text(text, data)
        _MEMO[memo] = found
        path = store.write(key, {"material": material, "passed": True, "finding": "", "text": text, "data": data})
        return replace(found, cache_file=str(path) if path is not None else None,
                       seconds=round(time.perf_counter() - start, 3), not_patched=list(found.not_patched))
