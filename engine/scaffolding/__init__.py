"""Scaffold: find a family's declarations by measurement, and write them as a patchset.

Why: writing a patchset by reading the modeling file is how the anchors got a norm's
parameterization wrong for months. The scaffold builds (or takes) a tiny perturbed model,
captures the real inputs of every module and of every module-level function its forwards
call, and runs every declaration every op offers for it (:meth:`ModuleOp.candidates`,
:meth:`FunctionOp.candidates`) against the original, in fp32 *and* bf16 (fp32 alone cannot
tell two cast orders apart). A declaration is kept only when it is bit-exact on every
instance in both dtypes and no other declaration is; a tie is reported, never resolved by
guessing. What no op computes is listed, with the closest miss.

Every class counts, wherever its code lives: transformers' own, a ``trust_remote_code``
checkpoint's (``transformers_modules.*``), a user's module or ``torch.nn``. Each one that
looks like a norm, MLP, rope or LM head by its name, or that some op could replace, gets a
measured declaration or a ``# not patched`` line saying why; nothing is dropped silently.

``engine.scaffold(model_or_type)`` returns a :class:`Scaffold`; ``str(scaffold)`` (or
:meth:`Scaffold.to_yaml`) is the patchset text; ``patch-engine scaffold MODEL_TYPE`` (or
``--model FOLDER``, see :mod:`engine.scaffolding.source`) prints it (``--out PATH`` writes it).
"""

from __future__ import annotations

import copy
import os
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from engine.errors import PatchError
from engine.ops.base import FunctionOp, ModuleOp, all_ops
from engine.runtime.hub_functions import torch_body, torch_path
from engine.scaffolding.capture import capture
from engine.scaffolding.findings import DTYPE_NAMES, DTYPES, Finding, Measurement
from engine.scaffolding.rendering import Scaffold
from engine.verification.compare import cast_floats, compare

__all__ = ["Finding", "Measurement", "Scaffold", "scaffold"]

#: Modules worth a "not patched" line when no op matches them, by the kind their name says.
MODULE_KINDS: dict[str, re.Pattern[str]] = {
    "norm": re.compile(r"Norm"),
    "mlp": re.compile(r"(MLP|Mlp|FeedForward|FFN|GLU|Glu|Experts?|MoeBlock|MoE|Moe)$"),
    "rope": re.compile(r"Rotary|Rope|RoPE"),
    "head": re.compile(r"ForCausalLM$|LMHead|LmHead"),
}
FUNCTION_KINDS = re.compile(r"rotary|rope|delta|kda|linear_attn|linear_attention|scan")


def module_kind(name: str) -> str | None:
    """``"norm"``, ``"mlp"``, ``"rope"`` or ``"head"`` when a class name says so, else ``None``."""
    return next((kind for kind, pattern in MODULE_KINDS.items() if pattern.search(name)), None)


def scaffold(
    model_or_type: nn.Module | str | os.PathLike[str],
    *,
    config: dict[str, Any] | None = None,
    seed: int = 0,
    trust_remote_code: bool = False,
    weights: bool = False,
) -> Scaffold:
    """Measure every declaration of every op on a tiny model of a family (see the module docstring).

    Args:
        model_or_type: a ``model_type`` (a tiny perturbed model is built from its config
            class's defaults, shrunk by :func:`engine.tiny.config.derive_tiny_config`); a
            local checkpoint folder (a ``Path``, or a string naming an existing folder that
            is no model type; see :func:`engine.scaffolding.source.model_from_folder`); or a
            model, measured as it is (on a deep copy; it should be small and its weights
            away from their init values), whatever module its classes come from.
        config: keys of the tiny config that override the derived ones (also written into
            the patchset's ``tiny_model`` block).
        trust_remote_code: for a folder whose ``config.json`` maps its own code (``auto_map``):
            run that code (read it first). Without it such a folder is refused.
        weights: for a folder: measure the checkpoint as saved (``from_pretrained``) instead
            of a tiny perturbed model built from its config (small checkpoints only).

    Example:
        >>> print(engine.scaffold(Path("my-checkpoint"), trust_remote_code=True))  # doctest: +SKIP
    """
    from engine.scaffolding.source import is_folder, model_from_folder, transformers_code
    from engine.tiny.config import derive_tiny_config

    tiny: dict[str, Any] | None
    tiny_type: str | None = None  # the tiny model's own type, where another type's model stands in
    note = ""
    if is_folder(model_or_type):
        folder = os.fspath(model_or_type)  # type: ignore[arg-type]
        model, tiny = model_from_folder(
            folder, trust_remote_code=trust_remote_code, weights=weights, config=config, seed=seed
        )
        model_type = str(model.config.model_type)
        flags = (" --trust-remote-code" if trust_remote_code else "") + (" --weights" if weights else "")
        source = f"patch-engine scaffold --model {folder}{flags}"
    elif isinstance(model_or_type, str):
        from engine.tiny.subject import tiny_subject

        model_type = model_or_type
        subject = tiny_subject(model_type, config, seed=seed)
        model, tiny, tiny_type, note = subject.model, subject.tiny_config, subject.tiny_type, subject.note
        source = f"patch-engine scaffold {model_type}"
    else:
        from engine.runtime.wrappers import unwrap

        model = copy.deepcopy(unwrap(model_or_type)).float()  # a PeftModel: the transformers model inside
        model_type = str(model.config.model_type)
        # the tiny_model block rebuilds the model only where transformers has all its code
        tiny = {**derive_tiny_config(model_type), **(config or {})} if transformers_code(model) else None
        source = f"engine.scaffold(<a {type(model).__name__}>)"
    # Training mode, as fine-tuning runs it and as verification checks it: a forward that
    # applies dropout (seed_oss's MLP) is then not reproducible, so nothing is declared for it.
    model.train()
    modules, functions = capture(model)
    with torch_path(model):  # a module's own forward may call functions bound to a package (fla on a CPU)
        findings = [*_module_findings(model, _Originals(modules)), *_function_findings(functions)]
    _explain_rope_modules(findings)
    foreign = {f.name: f.origin for f in findings if f.origin and not f.origin.startswith(("transformers.", "torch."))}
    return Scaffold(
        model_type=model_type, model_class=type(model).__name__, tiny_config=tiny, findings=findings,
        source=source, foreign=foreign, tiny_type=tiny_type if tiny_type != model_type else None, note=note,
        # the type the built model's config says (gpt-sw3 builds GPT-2 classes with a gpt2 config): the planner checks it
        also_types=[t for t in [str(model.config.model_type)] if t not in (model_type, tiny_type)],
    )


def _explain_rope_modules(findings: list[Finding]) -> None:
    """Say, on an unpatched rotary-embedding module, where its tables are applied (or that nothing can be)."""
    applied = [f.name for f in findings if f.kind == "function" and FUNCTION_KINDS.search(f.name)]
    for f in findings:
        if f.kind != "module" or module_kind(f.name) != "rope" or f.measurements or f.note:
            continue
        if applied:
            names = list(dict.fromkeys(applied))
            f.note = (f"no op replaces the module that computes the rotary tables; the rope op patches the "
                      f"function that applies them ({', '.join(names)}, see {'its line' if len(names) == 1 else 'their lines'})")
        else:
            f.note = ("no op replaces the module that computes the rotary tables, and no module-level function "
                      "the forwards call applies them (rope written inline in a forward cannot be patched: "
                      "move it into a function such as apply_rotary_pos_emb)")


# ---------------------------------------------------------------------------------------- modules


class _Originals:
    """Each called module's copy per dtype, its inputs in that dtype and its own output (computed once)."""

    def __init__(self, captured: dict[str, Any]):
        self.captured = captured
        self._cache: dict[tuple[str, torch.dtype], tuple[nn.Module, Any, Any, Any]] = {}

    def __contains__(self, path: str) -> bool:
        return path in self.captured

    def is_random(self, path: str, module: nn.Module) -> bool:
        """Whether the module's forward gives another result on the same input (dropout in training)."""
        clone, args, kwargs, expected = self.get(path, module, torch.float32)
        with torch.no_grad():
            again = type(clone).forward(clone, *args, **kwargs)
        return _error(again, expected) != 0.0

    def get(
        self, path: str, module: nn.Module, dtype: torch.dtype, op: ModuleOp | None = None
    ) -> tuple[nn.Module, Any, Any, Any]:
        """The copy, inputs and original output; ``op`` names the forward path it is judged against
        (:meth:`ModuleOp.ground_truth`: experts modules dispatch on the config)."""
        truth = op.ground_truth(module) if op is not None else type(module).forward
        key = (path, dtype, truth)
        if key not in self._cache:
            args, kwargs = self.captured[path]
            clone = copy.deepcopy(module).to(dtype)
            args, kwargs = cast_floats(args, dtype), cast_floats(kwargs, dtype)
            with torch.no_grad():
                expected = truth(clone, *args, **kwargs)
            self._cache[key] = (clone, args, kwargs, expected)
        return self._cache[key]


def _module_findings(model: nn.Module, originals: _Originals) -> Iterator[Finding]:
    by_class: dict[type, list[tuple[str, nn.Module]]] = {}
    for path, module in model.named_modules():
        by_class.setdefault(type(module), []).append((path, module))
    module_ops = [op for op in all_ops().values() if isinstance(op, ModuleOp)]
    for cls, members in by_class.items():
        called = [(p, m) for p, m in members if p in originals]
        finding = Finding("module", cls.__name__, len(called), origin=cls.__module__)
        for op in module_ops:
            candidates = _candidates(op, members)
            if not candidates:
                continue
            if op.opt_in:
                _check_opt_in(op, candidates, members, finding)
                continue
            mine = [_measure_module(op, patch, members, called, originals) for patch in candidates]
            # a declaration that cannot run, or returns another shape or dtype, does not apply
            applicable = [m for m in mine if m.problem is None and all(e < float("inf") for e in m.errors.values())]
            if applicable:
                finding.measurements.extend(applicable)
            else:
                finding.refused.append((op.name, min((m.problem or "output shape or dtype differs" for m in mine), key=len)))
        if finding.measurements and not finding.exact and called and _is_random(originals, *called[0]):
            finding.note = "its own forward is random in training mode (dropout?), so no declaration can match"
        kind = module_kind(cls.__name__)
        if kind == "norm" and not finding.measurements and not finding.refused:
            finding.note = _no_norm_candidates(members[0][1])
        # whatever its module (transformers, remote code, a user's, torch.nn): refusals alone are
        # worth a line only for what looks like a norm, MLP, experts, rope or LM head
        if finding.measurements or finding.opt_in or kind is not None:
            yield finding


def _candidates(op: ModuleOp, members: list[tuple[str, nn.Module]]) -> list[Any]:
    """The op's candidates for the first module of each parameter layout the class's modules have, without repeats.

    Why not the first module's alone: one class may hold modules of another layout (Gemma 3n's
    RMSNorm: a weight everywhere but in the value norm, ``with_scale=False``), whose declaration
    (``weight_required: false``) the first module's candidates never include; each candidate is
    then measured on every module of the class, as before.
    """
    firsts: dict[tuple[str, ...], nn.Module] = {}
    for _, module in members:
        firsts.setdefault(tuple(name for name, _ in module.named_parameters(recurse=False)), module)
    seen: dict[str, Any] = {}
    for module in firsts.values():
        for patch in op.candidates(module):
            seen.setdefault(patch.model_dump_json(), patch)
    return list(seen.values())


def _is_random(originals: _Originals, path: str, module: nn.Module) -> bool:
    """:meth:`_Originals.is_random`, False where the forward cannot be rerun on its captured inputs alone."""
    try:
        return originals.is_random(path, module)
    except Exception:  # noqa: BLE001  (Inkling 2's softcapped SwiGLU: no rerun, no randomness to report)
        return False


def _no_norm_candidates(module: nn.Module) -> str:
    """Why no norm declaration could even be tried on a norm-named module."""
    from engine.ops.base import norm_parameter_names

    weights, eps = norm_parameter_names(module)
    return (
        "no norm declaration can be tried: rms_norm and layer_norm need a 1-d weight parameter and a float eps "
        f"attribute (found weights {weights or 'none'}, eps attributes {eps or 'none'}; an eps written as a "
        "literal inside forward cannot be declared: store it on the module)"
    )


def _check_opt_in(op: ModuleOp, candidates: list[Any], members: list[tuple[str, nn.Module]], finding: Finding) -> None:
    for patch in candidates:
        try:
            for _, module in members:
                op.check_target(module, patch)
        except Exception as exc:  # noqa: BLE001  (PatchError: refused; anything else: its check cannot run here)
            finding.refused.append((op.name, str(exc)))
        else:
            finding.opt_in.append(op.name)
            return


def _measure_module(
    op: ModuleOp, patch: Any, members: list[tuple[str, nn.Module]], called: list[tuple[str, nn.Module]],
    originals: _Originals,
) -> Measurement:
    result = Measurement(patch)
    try:
        for _, module in members:
            op.check_target(module, patch)
    except PatchError as exc:
        result.problem = str(exc)
        return result
    except Exception as exc:  # noqa: BLE001  (a check that cannot even run on this module: no match, the sweep goes on)
        result.problem = f"{op.name}'s check raised {type(exc).__name__}: {exc}"
        return result
    if not called:
        result.problem = "never called in the probe forward"
        return result
    reference = op.reference(patch)
    for dtype in DTYPES:
        worst = 0.0
        for path, module in called:
            try:
                clone, args, kwargs, expected = originals.get(path, module, dtype, op)
                with torch.no_grad():
                    got = op.bind(clone, patch, reference)(clone, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001  (a declaration that cannot run is no match)
                result.problem = f"{type(exc).__name__}: {exc}"
                return result
            worst = max(worst, _error(got, expected))
        result.errors[DTYPE_NAMES[dtype]] = worst
    return result


def _error(got: Any, expected: Any) -> float:
    """Max abs error; ``inf`` where structures, shapes or dtypes differ (never exact then)."""
    try:
        max_abs, _, ok = compare(got, expected)
    except ValueError:  # another number of outputs: DiffusionGemma's router returns 3 tensors, a norm's reference 1
        return float("inf")
    return max_abs if ok or max_abs else float("inf")


# ---------------------------------------------------------------------------------------- functions


def _function_findings(captured: dict[tuple[str, str], Any]) -> Iterator[Finding]:
    function_ops = [op for op in all_ops().values() if isinstance(op, FunctionOp)]
    names: dict[str, list[tuple[Any, Any]]] = {}
    origins: dict[str, str] = {}
    for (namespace, name), (function, inputs) in captured.items():
        names.setdefault(name, []).append((function, inputs))
        origins.setdefault(name, str(getattr(torch_body(function), "__module__", "") or namespace))
    for name, sites in names.items():
        called = [(f, inputs) for f, inputs in sites if inputs is not None]
        finding = Finding("function", name, len(called), origin=origins[name])
        for op in function_ops:
            for patch in op.candidates(name, torch_body(sites[0][0])):
                finding.measurements.append(_measure_function(op, patch, called))
        if finding.measurements and not called:
            finding.note = "never called in the probe forward or a decode step"
        elif finding.measurements and len(called) < len(sites):
            # a function patch routes the name in every modeling module that defines it: one never run is unmeasured
            idle = sorted({str(getattr(torch_body(f), "__module__", "")) for f, inputs in sites if inputs is None})
            finding.note = (f"defined in {len(sites)} modeling modules, and the probe forward never calls the one in "
                            f"{', '.join(idle)} (a vision tower's?), so a patch of the name there is unmeasured")
        if finding.measurements or FUNCTION_KINDS.search(name):
            yield finding


def _measure_function(op: FunctionOp, patch: Any, called: list[tuple[Any, Any]]) -> Measurement:
    result = Measurement(patch)
    if not called:
        result.problem = "never called in the probe forward or a decode step"
        return result
    reference = op.reference(patch)
    for dtype in DTYPES:
        worst = 0.0
        for function, (args, kwargs) in called:
            a, k = cast_floats(args, dtype), cast_floats(kwargs, dtype)
            try:
                with torch.no_grad():
                    expected = torch_body(function)(*a, **k)
                    got = reference(*a, **k)
            except Exception as exc:  # noqa: BLE001
                result.problem = f"{type(exc).__name__}: {exc}"
                return result
            worst = max(worst, _error(got, expected))
        result.errors[DTYPE_NAMES[dtype]] = worst
    return result
