"""A tiny perturbed copy of a model, built from the model's *own* config class and model class.

Why its own classes and not its type name: a ``trust_remote_code`` checkpoint, a family
registered from outside transformers, or a renamed copy of one has a ``model_type`` that
:func:`engine.tiny.build_tiny_model` cannot build (or builds as transformers' class of that
name, which may compute something else). ``type(config).from_dict`` and
``type(model)._from_config`` rebuild exactly the code the user runs, at the sizes of
:data:`engine.tiny.BASE_KWARGS` and the size rules of :func:`engine.tiny.config.tiny_overrides`
(the same rules ``patch-engine scaffold --model FOLDER`` shrinks a folder's config with).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
from torch import nn

from engine.errors import InvalidArgument
from engine.tiny import BASE_KWARGS, perturb_
from engine.tiny.adopt import adopt_classes
from engine.tiny.config import tiny_overrides
from engine.tiny.construction import own_construction

__all__ = ["MAX_TINY_PARAMETERS", "code_identity", "shrunk_config", "tiny_copy"]

#: A tiny copy larger than this means the size rules missed the config's own size keys: not measured.
MAX_TINY_PARAMETERS = 50_000_000


def _shrink(values: dict[str, Any]) -> dict[str, Any]:
    sizes = {k: v for k, v in {**BASE_KWARGS, **tiny_overrides(values)}.items() if k in values}
    return {**values, **sizes}


def _agreeing_sizes(shrunk: dict[str, Any], original: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """``shrunk`` with the sizes ``types.yaml`` gives the type where the size rules changed the user's value.

    Why: some types need sizes that agree in ways the name rules do not see (Mistral 4's query head
    of nope + rope halves: ``head_dim`` 32; xLSTM's cache rounding its qk width up to 64); the rules
    alone give them a tiny copy that does not run. Only integers, and only where the rules already
    replaced the user's value: the entries' other keys (a multimodal rope's sections, layer kinds)
    describe a default config, and would replace what the user's own config says.
    """
    out = dict(shrunk)
    for key, value in entry.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and isinstance(original.get(key), dict):
            out[key] = _agreeing_sizes(out[key], original[key], value)
        elif isinstance(value, int) and not isinstance(value, bool) and key in out and out[key] != original.get(key):
            out[key] = value
    return out


def _shrunk_values(config: Any) -> dict[str, Any]:
    from engine.tiny.config import type_overrides

    original = config.to_dict()
    values = dict(original)
    for name in getattr(type(config), "sub_configs", None) or {}:
        sub = values.get(name)
        if isinstance(sub, dict):
            values[name] = _shrink(sub)
    values = _shrink(values)
    values = _agreeing_sizes(values, original, type_overrides(str(original.get("model_type") or "")))
    values.pop("transformers_version", None)
    return values


def _with_type_sizes(config: Any) -> dict[str, Any] | None:
    """The user's values with every size the type's own tiny config sets, for a copy the rules alone cannot build.

    Why: a composite's parts must agree across sub-configs (a vision tower's ``out_hidden_size`` is
    the text model's width; a hybrid's layer counts sum to ``num_hidden_layers``), which shrinking
    each part by name breaks. :func:`engine.tiny.config.derive_tiny_config` knows those agreements
    for the types transformers ships (that is what builds them for coverage and ``verify``), so
    where the rules' copy does not build, its sizes go over the user's values: the user's
    activations, norms and rope kind stay. Only for transformers' own config class of the type
    (``None`` otherwise: remote code has no derived config to trust).
    """
    from transformers import CONFIG_MAPPING

    from engine.tiny.config import derive_tiny_config, merged

    model_type = str(getattr(config, "model_type", "") or "")
    if model_type not in CONFIG_MAPPING or CONFIG_MAPPING[model_type] is not type(config):
        return None
    values = merged(_shrunk_values(config), derive_tiny_config(model_type))
    return {k: v for k, v in values.items() if v is not None or k not in BASE_KWARGS}


def shrunk_config(config: Any, *, by_type: bool = False) -> Any:
    """A config of ``type(config)`` with its sizes (and those of its sub-configs: text, vision) shrunk.

    ``by_type``: with the type's own tiny sizes over them (:func:`_with_type_sizes`).
    """
    values = _with_type_sizes(config) if by_type else _shrunk_values(config)
    if values is None:
        raise InvalidArgument(f"{type(config).__name__} is not transformers' config class of its type: no tiny sizes "
                              "of the type to build it with")
    small = type(config).from_dict(values)
    small._attn_implementation = "eager"
    for name in getattr(type(small), "sub_configs", None) or {}:
        sub = getattr(small, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            sub._attn_implementation = "eager"
    return small


def tiny_copy(model: nn.Module, *, seed: int = 0) -> nn.Module:
    """``type(model)`` built from :func:`shrunk_config` of its config, fp32, perturbed, in training mode, with the
    user's own module classes where they replaced transformers' (:func:`engine.tiny.adopt.adopt_classes`).

    The copy must run where the scaffold and the verifier run it: one forward of the engine's probe
    batch (:func:`engine.verification.probes.probe_batch`) and its vision step (:func:`_runs_on_probes`).
    Its sizes, the first of these that builds and runs:

    1. the size rules (:func:`engine.tiny.config.tiny_overrides`) over the user's values;
    2. the type's own tiny sizes over those (:func:`_with_type_sizes`: parts that must agree, a
       probe-sized layout such as MusicGen's one codebook);
    3. the user's own sizes, for a model already as small as a tiny copy (at most
       :data:`OWN_SIZES_LIMIT` parameters: a test's config, a toy). Why: the rules set sizes for a
       checkpoint's config; on a config that is already tiny they *grow* some sizes past others that
       must agree with them (a vision tower's width 48 -> 64 beside its 12 heads, 2 -> 4 KV heads
       beside a per-layer list of 2 query heads, a hidden size 32 -> 64 beside axial position factors
       summing to 32, 16 cache slots cut to 2 beside 2 layers per stack run 8 times).

    Raises :class:`InvalidArgument` where none does (the caller reports it: nothing is measured
    then): where a copy built, what stopped the one that got furthest on the probe inputs and at which
    sizes (its words hold :data:`NO_PROBE_INPUTS`: a forward that needs inputs the engine does not
    make, a loss that takes other labels), else the first candidate's error.
    """
    cls = type(model)
    config = getattr(model, "config", None)
    if config is None or not hasattr(cls, "_from_config"):
        raise InvalidArgument(f"{cls.__name__} is no transformers PreTrainedModel (no config, no _from_config): "
                              "nothing to build a tiny copy from; name a patchset")
    tried: list[tuple[str, Exception]] = []
    for what, make in _candidates(model, config):
        try:
            small = make()
        except InvalidArgument:  # not transformers' config class of its type: no type sizes to try
            continue
        except Exception as exc:  # noqa: BLE001  (sizes its config class refuses: T5Gemma 2's encoder and
            tried.append((what, exc))  # decoder widths must agree, which the rules shrink apart; the next candidate)
            continue
        try:
            tiny = _built(cls, small, seed)
            adopt_classes(tiny, model)  # the user's own module classes where they replaced transformers' (same layout)
            _runs_on_probes(tiny)
        except Exception as exc:  # noqa: BLE001  (sizes that do not build or run: the next candidate)
            tried.append((what, exc))
            continue
        return tiny
    raise _no_copy(cls, tried) from None


#: A model of at most this many parameters is copied at its own sizes where the size rules' copy does not run.
OWN_SIZES_LIMIT = 5_000_000
#: Every :func:`tiny_copy` error where the copy builds but does not run as the scaffold and the verifier run it says this.
NO_PROBE_INPUTS = "the engine's probe"
#: Parameters of a forward the probe batch can hold (token ids, labels, a composite's images and masks).
_PROBED = {"input_ids", "labels", "pixel_values", "attention_mask", "image_embeds_position_mask", "qformer_input_ids"}


def _candidates(model: nn.Module, config: Any) -> list[tuple[str, Any]]:
    found: list[tuple[str, Any]] = [("the size rules", lambda: shrunk_config(config)),
                                    ("the type's tiny sizes", lambda: shrunk_config(config, by_type=True))]
    if sum(p.numel() for p in model.parameters()) <= OWN_SIZES_LIMIT:
        found.append(("its own sizes", lambda: _own_config(config)))
    return found


def _own_config(config: Any) -> Any:
    """A copy of ``config`` as it is, eager attention (as :func:`shrunk_config`'s)."""
    import copy

    own = copy.deepcopy(config)
    for part in [own, *(getattr(own, n, None) for n in getattr(type(own), "sub_configs", None) or {})]:
        if part is not None and hasattr(part, "_attn_implementation"):
            part._attn_implementation = "eager"
    return own


class _NotRunning(Exception):
    """The tiny copy's failure on the probe inputs: how far it got (:data:`_STAGES`), why, and what it was given."""

    def __init__(self, stage: int, error: Exception | None, inputs: str = ""):
        why = f": {type(error).__name__}: {' '.join(str(error).split())}" if error is not None else ""
        given = f" ({inputs})" if inputs and stage > 0 else ""
        super().__init__(f"{_STAGES[stage]}{given}{why}")
        self.stage, self.error = stage, error


#: What failed, by how far the copy got (a later stage: a copy nearer to running).
_STAGES = (
    "the engine's probe inputs cannot be made from its config",
    "its forward fails on the engine's probe inputs",
    "its loss does not take the engine's probe labels",
    ("it returns neither a loss, hidden states nor logits on the engine's probe inputs, so no training step can be "
     "compared"),
    "its vision tower fails on the engine's probe images",
)


def _runs_on_probes(tiny: nn.Module) -> None:
    """Raise :class:`_NotRunning` where the tiny copy fails as the scaffold and the verifier run it, else nothing.

    The probe batch with its labels (the verifier's whole-model check), whose output must hold a loss,
    or the hidden states or logits the verifier's surrogate loss reads (``engine.verification.models._run``), then
    the vision step, which may fail only as the verifier's ``_vision_step`` lets it (a ``RuntimeError``
    stops the verification).
    """
    import inspect

    from engine.runtime.hub_functions import torch_path
    from engine.tiny.vision_inputs import image_features, tiny_vision_inputs
    from engine.verification.probes import probe_batch

    params = inspect.signature(tiny.forward).parameters.values()
    required = [p.name for p in params if p.default is inspect.Parameter.empty and p.name not in _PROBED
                and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    with torch.no_grad(), torch.random.fork_rng(devices=[]), torch_path(tiny):
        try:
            batch = probe_batch(tiny)
        except Exception as exc:
            if required:  # the plain reason: what its forward needs that no probe makes
                raise _NotRunning(0, None) from InvalidArgument(
                    f"its forward requires {', '.join(required)} (no default), which the engine's probes do not make")
            raise _NotRunning(0, exc) from exc
        inputs = ", ".join(f"{k} {tuple(v.shape)}" for k, v in batch.items() if isinstance(v, torch.Tensor))
        try:
            out = tiny(**batch)
        except Exception as exc:
            try:
                tiny(**{k: v for k, v in batch.items() if k != "labels"})
            except Exception:  # noqa: BLE001
                raise _NotRunning(1, exc, inputs) from exc
            raise _NotRunning(2, exc, inputs) from exc
        if getattr(out, "loss", None) is None and not (isinstance(out, dict) and "last_hidden_state" in out) \
                and getattr(out, "logits", None) is None:
            raise _NotRunning(3, None, inputs)
        pixels = tiny_vision_inputs(tiny)
        try:
            if pixels is not None:
                image_features(tiny, pixels)
        except (TypeError, ValueError, AttributeError, NotImplementedError):
            pass
        except Exception as exc:
            raise _NotRunning(4, exc, ", ".join(f"{k} {tuple(v.shape)}" for k, v in pixels.items())) from exc


def _no_copy(cls: type, tried: list[tuple[str, Exception]]) -> Exception:
    """The error of :func:`tiny_copy` where no candidate builds and runs: the run that got furthest, else the first."""
    running = [(exc.stage, what == "its own sizes", what, exc) for what, exc in tried if isinstance(exc, _NotRunning)]
    if running:
        _, own, what, exc = max(running, key=lambda r: r[:2])
        required = exc.__cause__ if exc.error is None and isinstance(exc.__cause__, InvalidArgument) else None
        at = "at its own sizes" if own else f"at {what}"
        return InvalidArgument(f"{required or exc} ({at})")
    return tried[0][1] if tried else InvalidArgument(f"no sizes to build a tiny copy of {cls.__name__} with")


def _built(cls: type, small: Any, seed: int) -> nn.Module:
    with own_construction("cpu"):
        with torch.device("meta"):
            shape = cls._from_config(small)
        count = sum(p.numel() for p in shape.parameters())
        if count > MAX_TINY_PARAMETERS:
            raise InvalidArgument(f"a tiny copy of {cls.__name__} would still have {count / 1e6:.0f}M parameters: "
                                  "the size rules do not know its size keys")
        torch.manual_seed(seed)
        tiny = cls._from_config(small)
    return perturb_(tiny.float(), seed=seed).train()


def code_identity(model: nn.Module) -> dict[str, Any]:
    """What a measurement depends on besides the release: the classes, the identity of their live code, the config.

    The code is read from the live objects (:func:`engine.foundation.code_identity.code_identity`
    of every class in the model and of its config class), not from a file: a layer file edited
    between two processes, a class's forward rebound in Python, or classes defined in a notebook
    (no file at all) each give another identity, so no cached measurement or verdict is reused
    for code it was not measured on.
    """
    from engine.foundation.code_identity import code_identity as live_identity

    cls, config = type(model), model.config
    small = _shrunk_values(config)
    classes = {type(m) for m in model.modules()} | {type(config)}
    code = sorted(f"{c.__module__}.{c.__qualname__}={live_identity(c)}" for c in classes)
    return {
        "model_type": str(getattr(config, "model_type", "")),
        "model_class": f"{cls.__module__}.{cls.__qualname__}",
        "config_class": f"{type(config).__module__}.{type(config).__qualname__}",
        "code": code,
        "config_sha256": hashlib.sha256(json.dumps(small, sort_keys=True, default=str).encode()).hexdigest(),
    }
