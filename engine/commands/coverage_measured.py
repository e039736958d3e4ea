"""Coverage's "measured" column: what zero configuration patches on a type with no bundled patchset.

For each generative type (causal LM or image-text-to-text) the scaffold measures every op on the
type's tiny model, and the patchset it writes is verified on that tiny model by the same verifier
as a bundled one (``patch-engine verify``). This is what ``engine.apply(model)`` with no patchset
does for such a type (it measures a tiny copy of the user's own model). A type with nothing
patched says why: its tiny model does not build, or no op the engine fuses computes any of its
modules (and which ones would have to).

A composite the scaffold measures through a stand-in (:func:`engine.tiny.subject.tiny_subject`
takes its language model where the composite does not run on token ids or does not build) is
counted by what a user gets instead (:func:`composite_entry`): ``engine.apply(model)`` on the tiny
model of the composite's own class, then verified; where that patches nothing, raises, or the
composite does not build here, the entry says "not patched" and why. The language model, a model
the user does not hold, never counts for the composite.

The sweep takes minutes per dozen types on 2 cores, so its results are data
(``benchmarks/results/coverage_measured.json``), written after every type so that a stopped
sweep resumes where it stopped; ``patch-engine coverage`` renders from them.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_DATA", "composite_entry", "load_measured", "measure_type", "measure_types"]

#: Where the sweep's results live (committed beside the page they render into).
DEFAULT_DATA = Path("benchmarks/results/coverage_measured.json")


def _reason(exc: BaseException, limit: int = 220) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _unpatched(result: Any) -> str:
    """Why nothing was patched: the modules that look like a norm, MLP, rope or head, and what they lack."""
    from engine.scaffolding import module_kind

    kinds: dict[str, list[str]] = {}
    for f in result.findings:
        if f.chosen is not None or f.instances == 0:
            continue
        kind = module_kind(f.name) if f.kind == "module" else ("rope" if "rot" in f.name else "function")
        if kind in (None, "head"):
            continue
        kinds.setdefault(kind, []).append(f.name)
    if not kinds:
        return ("no op the engine fuses: no module the probe forward calls looks like a norm, MLP or rope "
                "(what it would take: an op for its own blocks)")
    parts = [f"{kind} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}" for kind, names in kinds.items()]
    return ("no op the engine fuses computes them exactly: " + "; ".join(parts)
            + " (what it would take: an op whose reference is bit-exact on these; see `patch-engine scaffold "
            + result.model_type + "`)")


def measure_type(model_type: str) -> dict[str, Any]:
    """One type's entry: the ops measured and whether the measured patchset verifies, or why not."""
    from engine.commands.coverage import verify_patchset
    from engine.loader import load_patchset
    from engine.scaffolding import scaffold
    from engine.tiny.subject import tiny_subject

    start = time.perf_counter()
    entry: dict[str, Any] = {"patches": 0, "ops": "", "verified": None}
    try:
        stand_in = bool(tiny_subject(model_type).note)
    except Exception:  # noqa: BLE001  (the scaffold below meets the same failure and says why)
        stand_in = False
    if stand_in:  # the scaffold would measure its language model: the column counts the composite's own apply
        entry = composite_entry(model_type)
        entry["seconds"] = round(time.perf_counter() - start, 1)
        return entry
    try:
        result = scaffold(model_type)
    except Exception as exc:  # noqa: BLE001  (the row says why; the sweep goes on)
        built = not (str(exc).startswith("could not build") or type(exc).__name__ in ("InvalidArgument",
                                                                                      "StrictDataclassClassValidationError"))
        entry["reason"] = ("the scaffold failed on its tiny model: " if built else "its tiny model does not build: ") + _reason(exc)
        entry["seconds"] = round(time.perf_counter() - start, 1)
        return entry
    patches = result.patches
    entry["patches"] = len(patches)
    entry["ops"] = ", ".join(sorted({p.op for p in patches}))
    if not patches:
        entry["reason"] = _unpatched(result)
    else:
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "measured.yaml"
            path.write_text(result.to_yaml(), encoding="utf-8")
            try:
                ok, why = verify_patchset(load_patchset(str(path)))
            except Exception as exc:  # noqa: BLE001
                ok, why = False, _reason(exc)
        entry["verified"] = ok
        if not ok:
            entry["reason"] = "the measured patchset does not verify: " + why.replace(str(path), "measured.yaml")
    entry["seconds"] = round(time.perf_counter() - start, 1)
    return entry


def composite_entry(model_type: str) -> dict[str, Any]:
    """What ``engine.apply(model)`` with no patchset does on the tiny model of the composite itself, verified.

    The tiny model is built as the scaffold builds it (the type's derived tiny config, perturbed;
    :func:`engine.tiny.subject.tiny_subject`), but never replaced by its language model: the entry is
    the composite's patches and ops and the verifier's verdict on the patched composite, else
    "not patched" with its one reason (the composite does not build here, ``apply`` raised, or it
    patched nothing and why).
    """
    import warnings

    import engine
    from engine.commands.tester_configs import nothing_reason
    from engine.tiny import build_tiny_model
    from engine.tiny.config import derive_tiny_config
    from engine.verification.runner import verify

    entry: dict[str, Any] = {"patches": 0, "ops": "", "verified": None}
    try:
        model = build_tiny_model(model_type, derive_tiny_config(model_type), seed=0, check_size=True)
    except Exception as exc:  # noqa: BLE001  (the row says why)
        entry["reason"] = "not patched: its tiny model (the composite) does not build here: " + _reason(exc)
        return entry
    name = type(model).__name__
    entry["class"] = name
    try:
        with warnings.catch_warnings():  # the zero-configuration warning says what the entry says
            warnings.simplefilter("ignore")
            report = engine.apply(model)
    except Exception as exc:  # noqa: BLE001
        entry["reason"] = f"not patched: engine.apply(model) raised on {name}: " + _reason(exc)
        return entry
    if not report.patched:
        entry["reason"] = f"not patched: engine.apply(model) patched nothing on {name}: " + nothing_reason(report.zero_config)
        return entry
    entry["patches"] = len(report.patched)
    entry["ops"] = ", ".join(sorted({d.op for d in report.decisions if d.action == "patch"}))
    try:
        checked = verify(model, raise_on_failure=False)
        ok, why = bool(checked.passed), ", ".join(sorted({c.cls for c in checked.failures}))
    except Exception as exc:  # noqa: BLE001
        ok, why = False, _reason(exc)
    finally:
        engine.revert(model)
    entry["verified"] = ok
    entry["note"] = f"engine.apply(model) on the composite ({name}) itself"
    if not ok:
        entry["reason"] = f"the patched {name} does not verify: {why}"
    return entry


def load_measured(path: str | Path = DEFAULT_DATA) -> dict[str, dict[str, Any]]:
    """The sweep's entries by model type (empty when there is no file yet)."""
    file = Path(path)
    if not file.is_file():
        return {}
    return dict(json.loads(file.read_text(encoding="utf-8")).get("types", {}))


def measure_types(model_types: list[str], path: str | Path = DEFAULT_DATA, *, again: bool = False,
                  log: Any = None) -> dict[str, dict[str, Any]]:
    """Measure each type not yet in ``path`` (every one with ``again``), writing the file after each."""
    import transformers

    file = Path(path)
    entries = load_measured(file)
    for model_type in model_types:
        if model_type in entries and not again:
            continue
        entries[model_type] = measure_type(model_type)
        if log is not None:
            e = entries[model_type]
            log(f"{model_type}: {e['ops'] or '-'} verified={e['verified']} {e['seconds']}s {e.get('reason', '')[:120]}")
        data = {"transformers": transformers.__version__, "types": dict(sorted(entries.items()))}
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return entries
