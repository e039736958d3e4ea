"""One model type on transformers' own test config: its ``ModelTester``'s model, ``engine.apply(model)``, compared.

The measurement behind :mod:`engine.commands.coverage_testers` (coverage's second column). For one
model type: the test file of its family in transformers' test tree (``../shared/hf-tests``, unpacked
under ``.hf-suite/testers``), the test class that tests the type's generative class (its
image-text-to-text class, else its causal LM: the composite, not its language model), that class's
``ModelTester``: its config and its own inputs (``prepare_config_and_inputs_for_common``, then the
test's ``_prepare_for_class``). The model is built as the test builds it (``model_class(config)``),
seeded, its weights perturbed (:func:`engine.tiny.perturb_`: a freshly initialized norm is all ones,
where a wrong scale would go unseen), then three copies run the same trajectory:

* the unpatched model in fp32 (what the user had);
* the same, evaluated in fp64 with transformers' own roundings undone (:mod:`engine.verification.truth`'s
  mode on an fp64 copy: ``.float()`` and ``dtype=torch.float32`` inside norms, softmax and the loss are
  no-ops there), the truth the project's judge measures both against;
* the model after ``engine.apply(model)`` with no patchset (zero configuration; planned for training).

The trajectory: logits on the tester's inputs, one training step (the model's own loss on
``labels = input_ids`` where its forward takes labels, else the mean square of its logits;
backward; SGD at :data:`LR`), logits again. Every run is in training mode with dropout 0
(:func:`no_dropout`), so the three differ only by rounding. Each patched result is judged against the
unpatched one with the verifier's own rule (:func:`engine.verification.compare.judge`: bit-equal, or within 3x the
unpatched model's own error against the fp64 truth, plus one ulp of the result's scale).

The test tree and how its testers are found: :mod:`engine.commands.tester_tree`. A tester that does
not build on the installed release says why (``tester does not build``), without the engine.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

from engine.commands.tester_tree import (
    DEPS_DIR,
    ROOT,
    STUBBED,
    TESTS_DIR,
    Found,
    TesterDoesNotBuild,
    find_tester,
    install_import_shim,
    reason,
    setup,
)

__all__ = ["LR", "judged", "measure", "no_dropout", "nothing_reason", "trajectory", "worker"]

#: The SGD step's learning rate: large enough that one step moves the logits by a visible amount
#: (each entry records how much: ``step_moved``), small enough not to blow a tiny model up.
LR = 0.1


def _seed() -> None:
    """The testers' random inputs the same in every sweep: torch's, Python's and the test tree's own generator."""
    import random

    import torch

    random.seed(0)
    torch.manual_seed(0)
    common = sys.modules.get("tests.test_modeling_common")
    if common is not None and hasattr(common, "global_rng"):
        common.global_rng.seed(0)


def _batch(found: Found) -> tuple[Any, dict[str, Any]]:
    """The tester's config and inputs for the class (a sub-config: the inputs its forward takes)."""
    _seed()
    config, inputs = found.case.model_tester.prepare_config_and_inputs_for_common()
    if hasattr(found.case, "_prepare_for_class"):
        inputs = found.case._prepare_for_class(inputs, found.model_cls)
    if found.sub_config is not None:
        config = getattr(config, found.sub_config)
        takes = inspect.signature(found.model_cls.forward).parameters
        inputs = {k: v for k, v in inputs.items() if k in takes and k not in ("pixel_values", "image_sizes")}
    return config, dict(inputs)


def _with_labels(model: Any, inputs: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The training batch: the tester's inputs with ``labels = input_ids`` where the forward takes labels."""
    takes = "labels" in inspect.signature(model.forward).parameters
    if "labels" in inputs:
        return inputs, "the tester's labels"
    if takes and "input_ids" in inputs:  # every position (a tester's random mask may be all zeros: falcon_mamba's)
        return {**inputs, "labels": inputs["input_ids"].clone().long()}, "its own loss on labels = input_ids"
    return inputs, "the mean square of its logits (its forward takes no labels)"


def _logits_of(out: Any) -> Any:
    found = getattr(out, "logits", None)
    if found is None:
        found = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
    return found


def _logits(out: Any) -> Any:
    return _logits_of(out).detach().clone()


def no_dropout(config: Any = None, model: Any = None) -> None:
    """Every dropout probability 0: in the config (and its sub-configs) before the build, in the modules after.

    Why: the runs are compared in training mode (a model's training path: RWKV rescales its weights in
    place in eval mode, which its backward then refuses), and equal dropout masks in fp32 and in the fp64
    truth are not guaranteed; with no dropout the three runs differ by rounding only.
    """
    from torch import nn

    if config is not None:
        for key, value in list(vars(config).items()):
            if isinstance(value, float) and ("dropout" in key or "layerdrop" in key):
                setattr(config, key, 0.0)
            elif hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config
                no_dropout(value)
    for module in model.modules() if model is not None else ():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if isinstance(value, float) and "dropout" in key:
                setattr(module, key, 0.0)


def trajectory(model: Any, inputs: dict[str, Any], train: dict[str, Any], context: Any = None) -> dict[str, Any]:
    """Logits, one SGD step (loss, backward, step), logits again; ``context()`` around each forward (fp64 truth).

    In training mode (dropout 0, :func:`no_dropout`), each forward seeded alike (a router's jitter noise).
    """
    import contextlib

    import torch

    enter = context or contextlib.nullcontext
    model.train()
    torch.manual_seed(0)
    with torch.no_grad(), enter():
        before = _logits(model(**inputs))
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with enter():
        out = model(**train)
        own = "labels" in train and getattr(out, "loss", None) is not None
        loss = out.loss if own else _logits_of(out).square().mean()
    loss.backward()
    torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR).step()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    with torch.no_grad(), enter():
        after = _logits(model(**inputs))
    return {"logits": before, "loss": loss.detach(), "after_step": after}


def _truth_context() -> Any:
    from engine.verification.truth import fp64_truth

    return lambda: fp64_truth(None)


def _stage(path: Path | None, name: str) -> None:
    if path is not None:
        path.write_text(name)


def measure(model_type: str, stage_file: Path | None = None) -> dict[str, Any]:
    """One type's entry: ``result`` one of the five outcomes (see :mod:`engine.commands.coverage_testers`)."""
    import torch

    from engine.tiny import perturb_

    start, entry = time.perf_counter(), {"model_type": model_type}
    stubbed = len(STUBBED)
    try:
        _stage(stage_file, "tester")
        found = find_tester(model_type)
        model_cls = found.model_cls
        entry.update({"test": found.test, "class": model_cls.__name__})
        config, inputs = _batch(found)
        config = copy.deepcopy(config)
        no_dropout(config)
        torch.manual_seed(0)
        model = perturb_(model_cls(config), seed=0)
        no_dropout(model=model)
        model.train()  # built for training, as a user who trains applies it
        train, entry["loss"] = _with_labels(model, inputs)
        reference = copy.deepcopy(model)
        try:
            want = trajectory(reference, inputs, train)
        except Exception as exc:  # labels = input_ids may not fit its loss (musicgen's codebooks)
            if train is inputs:
                raise
            train, entry["loss"] = inputs, f"the mean square of its logits (labels = input_ids: {reason(exc, 120)})"
            reference = copy.deepcopy(model)
            want = trajectory(reference, inputs, train)
        wide = copy.deepcopy(model).double()
    except TesterDoesNotBuild as exc:
        return _done(entry, start, "tester does not build", reason=str(exc))
    except Exception as exc:  # noqa: BLE001  (the tester's own model, no engine in it)
        return _done(entry, start, "tester does not build", reason=reason(exc))
    finally:
        entry["stubbed"] = sorted(set(STUBBED[stubbed:]))
    try:
        truth = trajectory(wide, inputs, train, _truth_context())
    except Exception as exc:  # noqa: BLE001  (no fp64 truth: the fixed fp32 tolerances judge instead)
        truth, entry["truth"] = None, f"the fp64 truth does not run: {reason(exc)}"
    del wide
    _stage(stage_file, "engine")
    return _engine(model, inputs, train, want, truth, entry, start)


def _engine(model: Any, inputs: dict[str, Any], train: dict[str, Any], want: dict[str, Any], truth: Any,
            entry: dict[str, Any], start: float) -> dict[str, Any]:
    import engine

    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = engine.apply(model)
        entry["warnings"] = sorted({str(w.message)[:300] for w in caught if "patch-engine" in str(w.message)})
    except Exception as exc:  # noqa: BLE001  (must be none: recorded with its traceback's last engine frame)
        return _error(entry, start, "engine.apply", exc)
    zc = report.zero_config
    entry["source"] = getattr(zc, "source", None)
    entry["bundled"] = getattr(zc, "bundled", None)
    entry["not_patched"] = list(getattr(zc, "not_patched", []) or [])[:20]
    if not report.patched:
        return _done(entry, start, "nothing patched", reason=nothing_reason(zc))
    entry["patched"] = len(report.patched)
    entry["ops"] = sorted({d.op for d in report.decisions if d.action == "patch"})
    try:
        got = trajectory(model, inputs, train)
    except Exception as exc:  # noqa: BLE001
        return _error(entry, start, "the patched model's run", exc)
    finally:
        try:
            engine.revert(model)
        except Exception as exc:  # noqa: BLE001
            entry["revert"] = reason(exc)
    verdicts = {key: judged(got[key], want[key], None if truth is None else truth[key]) for key in want}
    entry["checks"] = {k: v[1] for k, v in verdicts.items()}
    entry["step_moved"] = f"{float((want['after_step'] - want['logits']).abs().max()):.3g}"
    wrong = [k for k, v in verdicts.items() if not v[0]]
    if wrong:
        return _done(entry, start, "patched wrong", reason="; ".join(f"{k}: {verdicts[k][1]}" for k in wrong))
    return _done(entry, start, "patched exactly")


def judged(got: Any, want: Any, truth: Any) -> tuple[bool, str]:
    """The verifier's judge against the fp64 truth; without one, the fixed fp32 tolerances (``compare``)."""
    import torch

    from engine.verification.compare import compare, judge

    same_nans = got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=0, equal_nan=True)
    if torch.equal(got, want) or same_nans:  # a NaN where the unpatched model has one is the same number
        return True, "bit-equal"
    if truth is not None:
        passed, note = judge(got, want, truth.to(want.device))
        return bool(passed), note
    err, rel, ok = compare(got, want)
    return ok, f"max abs {err:.2g}, rel {rel:.2g} (fixed fp32 tolerance: no fp64 truth)"


def nothing_reason(zc: Any) -> str:
    """Why zero configuration patched nothing: its problem, else the first modules it left unpatched and why."""
    if zc is None:
        return "no zero-configuration report"
    if getattr(zc, "problem", ""):
        return str(zc.problem)
    failed = getattr(zc, "failed", {}) or {}
    if failed:
        return "; ".join(f"{d}: {why}" for d, why in list(failed.items())[:2])
    lines = list(getattr(zc, "not_patched", []) or [])
    return "; ".join(lines[:3]) if lines else "no op of the engine computes any of its modules or functions exactly"


def _error(entry: dict[str, Any], start: float, where: str, exc: BaseException) -> dict[str, Any]:
    from engine import errors

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "/engine/" in f.filename]
    entry["error"] = {"where": where, "type": type(exc).__name__, "message": str(exc)[:600],
                      "raw": not isinstance(exc, errors.PatchError),
                      "engine_frame": f"{Path(frames[-1].filename).relative_to(ROOT)}:{frames[-1].lineno}"
                      if frames else None}
    return _done(entry, start, "engine error", reason=f"{where}: {reason(exc)}")


def _done(entry: dict[str, Any], start: float, result: str, *, reason: str = "", **extra: Any) -> dict[str, Any]:
    entry.update(extra)
    entry["result"] = result
    if reason:
        entry["reason"] = reason
    entry["seconds"] = round(time.perf_counter() - start, 1)
    return {k: v for k, v in entry.items() if v not in (None, [], {})}


def worker() -> int:
    """The sweep's worker process: one ``TYPE<TAB>RESULT_FILE`` line in, that type's entry written as JSON there."""
    import resource

    limit = int(float(os.environ.get("COVERAGE_TESTERS_MEMORY_GB", "10")) * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))  # a tester that allocates too much: its MemoryError
    setup()
    sys.path[:0] = [str(TESTS_DIR), str(DEPS_DIR)]
    os.chdir(TESTS_DIR)
    install_import_shim()
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    for line in sys.stdin:
        model_type, out = line.rstrip("\n").split("\t")
        path = Path(out)
        entry = measure(model_type, stage_file=path.with_suffix(".stage"))
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(entry, default=str))
        tmp.replace(path)
    return 0
