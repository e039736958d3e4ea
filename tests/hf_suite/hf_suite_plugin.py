"""pytest plugin: transformers' own modeling tests, with every model they build patched; outcomes to JSON.

Loaded by ``tests/hf_suite/run.py`` (``-p hf_suite_plugin``) into a pytest run of
``tests/models/<family>/test_modeling_<family>.py`` from transformers' own test tree. Configured
by the environment, because the run is a subprocess the runner starts:

- ``HF_SUITE_MODE``: ``off`` (nothing patched: the baseline), ``torch`` (the torch kernels,
  ``PATCH_ENGINE_COMPILE=0``), ``compiled`` (the compiled kernels on every call: the measured
  rows rule forced down to one row, so the tests exercise the inductor code, not the reference it
  falls back to on small inputs), ``interpret`` (the CUDA plan, liger and fla Triton kernels, run
  on the CPU tensors by Triton's interpreter: apply with ``device="cuda"`` and the whole session
  inside :func:`engine.kernels.triton_interpret.interpreting`).
- ``HF_SUITE_OUT``: the results JSON to write (outcome per test, models patched and refused).
- ``HF_SUITE_PATCHSET``: a bundled patchset to use for every model of its model types instead of
  the type's own (``qwen3_flce``: the fused head on the qwen3 tests).

What it changes, in every mode including ``off`` (so that both runs test the same models):
the testers' tiny configs mostly say ``hidden_act="gelu"``, which every swiglu patchset rightly
refuses (a SwiGLU with GELU is not the family's MLP). When a model is built, each activation
field (:data:`ACTIVATION_FIELDS`) of its config and sub-configs whose model type has a bundled
patchset is set to the config class's own default, the activation the family really uses
(``silu`` for Qwen3, ``gelu_pytorch_tanh`` for Gemma); every switch is counted in the JSON.

Where models are patched: right after ``PreTrainedModel.post_init`` (the end of every model's
``__init__``: ``__init__``, ``from_config``, and ``from_pretrained``'s construction) for the
outermost model only (a model built inside another model's ``__init__`` is part of it and is
patched with it), and again after ``from_pretrained`` returns (weights loaded, ``eval()``: the
mode may choose other kernels). A refusal of the planner (``engine.PatchError``) leaves the model
unpatched and is counted with its reason; any other exception from ``engine.apply`` is an engine
bug and propagates into the test, which then fails with it. Engine warnings during ``apply`` are
recorded, not shown to the test (tests that count warnings would otherwise differ).

Processes a test spawns (the FSDP2 and tensor-parallel tests: ``torch.multiprocessing.spawn``)
build their models too: ``sitecustomize.py`` beside this file installs the same hooks there
(:func:`start_child`), and their counts come back through a file of events merged at the end.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import threading
import time
import warnings
import weakref
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

MODE = os.environ.get("HF_SUITE_MODE", "off")
MODES = ("off", "torch", "compiled", "interpret")
#: Config fields naming the MLP's activation, per transformers' configs of the bundled types.
ACTIVATION_FIELDS = ("hidden_act", "hidden_activation", "activation_function")
#: A failure message is cut here: enough to see the cause, small enough for a results file per run.
MESSAGE_CHARS = 400
#: Set by the pytest process for the processes its tests spawn (sitecustomize.py reads it).
PARENT_ENV, NODEID_ENV = "HF_SUITE_PARENT_PID", "HF_SUITE_NODEID"


@dataclasses.dataclass
class Stats:
    """What happened to the models of this run; written to the JSON as it is."""

    built: int = 0  # outermost models built or loaded, each counted once
    patched: int = 0  # of those, patched by this plugin
    refused: Counter[str] = dataclasses.field(default_factory=Counter)  # planner refusals, by reason
    no_patchset: Counter[str] = dataclasses.field(default_factory=Counter)  # model types without a bundled patchset
    crashed: Counter[str] = dataclasses.field(default_factory=Counter)  # apply raised something else: engine bugs
    kernels: Counter[str] = dataclasses.field(default_factory=Counter)  # "op:kernel" per patched model
    warnings: Counter[str] = dataclasses.field(default_factory=Counter)  # engine warnings during apply
    activations: Counter[str] = dataclasses.field(default_factory=Counter)  # "type.field: tester -> family"
    in_children: int = 0  # models built in processes the tests spawned (included in built)


STATS = Stats()
_TESTS: dict[str, dict[str, Any]] = {}  # nodeid -> outcome, message, seconds, models built / patched
_CURRENT: dict[str, Any] = {"nodeid": None}
_SEEN: weakref.WeakSet[Any] = weakref.WeakSet()  # models counted as built already
_BUSY = threading.local()  # inside our own apply: models the engine builds (self-verification) are left alone
_CHILD_EVENTS: Path | None = None  # in a spawned process: where its events go
_INTERPRETING: Any = None  # the interpret mode's interpreting() block, open for the whole process


def _by_type() -> dict[str, str]:
    """model type -> the bundled patchset used for it: the one named after it (``qwen3``, not the
    opt-in ``qwen3_flce``), else the first listing it; ``HF_SUITE_PATCHSET`` wins for its types."""
    from engine.loader import bundled_names, load_patchset

    names: dict[str, list[str]] = {}
    for name in bundled_names():
        for model_type in load_patchset(name).model_types:
            names.setdefault(model_type, []).append(name)
    chosen = {t: (t if t in n else n[0]) for t, n in names.items()}
    override = os.environ.get("HF_SUITE_PATCHSET")
    if override:
        chosen.update(dict.fromkeys(load_patchset(override).model_types, override))
    return chosen


PATCHSET_FOR = _by_type()


def _event(kind: str, key: str = "", kernels: tuple[str, ...] = (), nodeid: str | None = None) -> None:
    """Count one thing that happened to a model (here, or in a spawned process: then to its file)."""
    if _CHILD_EVENTS is not None:
        with _CHILD_EVENTS.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"kind": kind, "key": key, "kernels": kernels,
                                "nodeid": os.environ.get(NODEID_ENV)}) + "\n")
        return
    if kind in ("built", "patched"):
        setattr(STATS, kind, getattr(STATS, kind) + 1)
        test = _TESTS.setdefault(nodeid or _CURRENT["nodeid"] or "<collection>", {})
        test[kind] = test.get(kind, 0) + 1
        STATS.kernels.update(kernels)
    else:
        getattr(STATS, kind)[key] += 1


def _declared_activations() -> dict[str, dict[str, str]]:
    """model type -> the activation fields its bundled patchset's ``tiny_model.config`` sets (the family's real one).

    Why: the config class's default is not always what the family's checkpoints use: PixtralVisionConfig
    defaults to ``gelu``, Pixtral checkpoints say ``silu``, and the pixtral patchset declares it there.
    """
    from engine.loader import load_patchset

    found: dict[str, dict[str, str]] = {}
    for model_type, name in PATCHSET_FOR.items():
        tiny = load_patchset(name).tiny_model
        if tiny is not None and (tiny.model_type or model_type) == model_type:
            fields = {k: v for k, v in dict(tiny.config).items() if k in ACTIVATION_FIELDS and isinstance(v, str)}
            if fields:
                found[model_type] = fields
    return found


DECLARED_ACTIVATIONS = _declared_activations()


def _family_activation(config: Any) -> None:
    """Set the activation fields of ``config`` (and its sub-configs) to the family's own: the one its patchset's
    tiny model declares, else the config class's default."""
    from transformers.configuration_utils import PreTrainedConfig

    if config.model_type in PATCHSET_FOR and dataclasses.is_dataclass(config):
        declared = DECLARED_ACTIVATIONS.get(config.model_type, {})
        for field in dataclasses.fields(config):
            if field.name not in ACTIVATION_FIELDS:  # others may refuse a read (Gemma 4's per-layer head_dim)
                continue
            value = getattr(config, field.name, None)
            own = declared.get(field.name, field.default)
            if isinstance(own, str) and value != own:
                setattr(config, field.name, own)
                _event("activations", f"{config.model_type}.{field.name}: {value} -> {own}")
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if isinstance(sub, PreTrainedConfig):
            _family_activation(sub)


def _inside_another_model(model: Any) -> bool:
    """Whether ``model`` is being built inside another model's ``__init__`` (a sub-model: patched with its parent).

    Why the stack: transformers builds a composite model depth-first and calls each sub-model's
    ``post_init`` first, with nothing on the sub-model saying it has a parent yet.
    """
    from transformers import PreTrainedModel

    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            owner = frame.f_locals.get("self")
            if owner is not model and isinstance(owner, PreTrainedModel):
                return True
        frame = frame.f_back
    return False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:MESSAGE_CHARS]


def patch(model: Any) -> None:
    """Apply the bundled patchset of ``model``'s type (a no-op in ``off`` mode); count what happened."""
    if getattr(_BUSY, "active", False):
        return
    if model not in _SEEN:
        _SEEN.add(model)
        _event("built")
    if MODE == "off":
        return
    import engine
    from engine.errors import PatchError

    model_type = getattr(model.config, "model_type", None)
    name = PATCHSET_FOR.get(model_type)
    if name is None:
        _event("no_patchset", str(model_type))
        return
    was_patched = engine.is_patched(model)
    _BUSY.active = True
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = engine.apply(model, name, device="cuda" if MODE == "interpret" else None)
    except PatchError as exc:
        _event("refused", f"{name} on {type(model).__name__}: {_first_line(exc)}")
        return
    except Exception as exc:
        _event("crashed", f"{name} on {type(model).__name__}: {_first_line(exc)}")
        raise
    finally:
        _BUSY.active = False
    for w in caught:
        _event("warnings", str(w.message).strip().splitlines()[0][:MESSAGE_CHARS])
    if was_patched:
        return
    if not report.patched:
        _event("refused", f"{name} on {type(model).__name__}: nothing patched (every patch skipped)")
        return
    _event("patched", kernels=tuple(sorted({f"{d.op}:{d.kernel}" for d in report.decisions if d.action == "patch"})))


def _install_hooks() -> None:
    """Wrap ``PreTrainedModel.__init__`` (activation), ``post_init`` and ``from_pretrained`` (patching)."""
    from transformers import PreTrainedModel

    init, post_init = PreTrainedModel.__init__, PreTrainedModel.post_init
    from_pretrained = PreTrainedModel.from_pretrained.__func__  # type: ignore[attr-defined]

    def __init__(self: Any, config: Any, *args: Any, **kwargs: Any) -> None:
        if not getattr(_BUSY, "active", False):
            _family_activation(config)
        init(self, config, *args, **kwargs)

    def patched_post_init(self: Any) -> None:
        post_init(self)
        if not _inside_another_model(self):
            patch(self)

    def patched_from_pretrained(cls: Any, *args: Any, **kwargs: Any) -> Any:
        loaded = from_pretrained(cls, *args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded
        if isinstance(model, PreTrainedModel) and not _inside_another_model(model):
            patch(model)  # patched at its post_init already, unless refused there on the meta device
        return loaded

    PreTrainedModel.__init__ = __init__  # type: ignore[method-assign]
    PreTrainedModel.post_init = patched_post_init  # type: ignore[method-assign]
    PreTrainedModel.from_pretrained = classmethod(patched_from_pretrained)  # type: ignore[method-assign,assignment]


def _start_mode() -> None:
    """The process-wide part of the mode: the compiled kernels' switch and threshold, Triton's interpreter."""
    # The compiled provider reads its switch whenever a plan is made: off everywhere but the compiled mode.
    os.environ["PATCH_ENGINE_COMPILE"] = "1" if MODE == "compiled" else "0"
    _install_hooks()
    if MODE == "compiled":
        from engine.kernels import compiled

        compiled.FORCED_ROWS = 1  # every call of at least one row runs the compiled kernel (compiled_from's switch)
    if MODE == "interpret":
        from engine.kernels.triton_interpret import interpreting

        global _INTERPRETING
        _INTERPRETING = interpreting()  # kept: a context manager collected unexited would exit itself
        _INTERPRETING.__enter__()  # for the whole process: models are patched and run inside it


def start_child() -> None:
    """In a process a test spawned: the same mode and hooks; counts to the parent's events file."""
    global _CHILD_EVENTS
    _CHILD_EVENTS = Path(os.environ["HF_SUITE_OUT"] + ".children.jsonl")
    _start_mode()


def pytest_configure(config: pytest.Config) -> None:
    if MODE not in MODES:
        raise pytest.UsageError(f"HF_SUITE_MODE={MODE!r}: expected one of {', '.join(MODES)}")
    os.environ[PARENT_ENV] = str(os.getpid())
    if os.environ.get("HF_SUITE_OUT"):
        Path(os.environ["HF_SUITE_OUT"] + ".children.jsonl").unlink(missing_ok=True)
    _start_mode()
    config._hf_suite_start = time.time()  # type: ignore[attr-defined]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    _CURRENT["nodeid"] = os.environ[NODEID_ENV] = item.nodeid
    try:
        return (yield)
    finally:
        _CURRENT["nodeid"] = None
        os.environ.pop(NODEID_ENV, None)


#: The outcome a test keeps when its reports disagree: the worst one (a failed subtest fails the test).
_RANK = ("passed", "xpassed", "skipped", "xfailed", "error", "failed")


def _outcome(report: pytest.TestReport) -> str:
    if report.skipped:
        return "xfailed" if hasattr(report, "wasxfail") else "skipped"
    if report.failed:
        return "failed" if report.when == "call" else "error"
    return "xpassed" if hasattr(report, "wasxfail") else "passed"


def _message(report: pytest.TestReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])[:MESSAGE_CHARS]
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr or "")
    sub = getattr(report, "context", None)
    where = f"subtest {report._sub_test_description()}: " if sub is not None else ""  # type: ignore[attr-defined]
    return (where + text.strip())[:MESSAGE_CHARS]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    test = _TESTS.setdefault(report.nodeid, {})
    test["seconds"] = round(test.get("seconds", 0.0) + report.duration, 3)
    if report.when != "call" and report.passed:
        return
    outcome = _outcome(report)
    if getattr(report, "context", None) is not None:  # a subtest: counted per outcome (an xfail test's are xfailed)
        subtests = test.setdefault("subtests", {})
        subtests[outcome] = subtests.get(outcome, 0) + 1
        if outcome != "passed" and "subtest_message" not in test:
            test["subtest_message"] = _message(report)
        if outcome in ("passed", "skipped", "xfailed"):
            return  # its test's own report says how the test went; a failed subtest fails it
    before = test.get("outcome", "passed")
    if "outcome" not in test or _RANK.index(outcome) > _RANK.index(before):
        test["outcome"] = outcome
        if outcome != "passed":
            test["message"] = _message(report)


def _merge_children(path: Path) -> None:
    """Count the events of spawned processes as this process's own, under the test that spawned them."""
    if not path.exists():
        return
    for line in path.read_text(encoding="utf-8").splitlines():
        event = json.loads(line)
        if event["kind"] == "built":
            STATS.in_children += 1
        _event(event["kind"], event["key"], tuple(event["kernels"]), nodeid=event["nodeid"])
    path.unlink()


def _plain(value: Any) -> Any:
    """A count as it is; a Counter as a plain dict, most frequent first."""
    return dict(value.most_common()) if isinstance(value, Counter) else value


def _compiled_state() -> dict[str, Any]:
    """The compiled kernels the run made: shape classes compiled per kernel, and any that gave up (fell back)."""
    if MODE != "compiled":
        return {}
    from engine.kernels import compiled

    return {kernel.label: {"shape_classes": len(kernel.functions), "failed": kernel.failed}
            for kernel in compiled.kernels().values()}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    out = os.environ.get("HF_SUITE_OUT")
    if not out:
        return
    import torch
    import transformers

    _merge_children(Path(out + ".children.jsonl"))
    tests = {k: v for k, v in _TESTS.items() if "outcome" in v}
    data = {
        "mode": MODE,
        "patchset_override": os.environ.get("HF_SUITE_PATCHSET"),
        "selection": os.environ.get("HF_SUITE_SELECTION", ""),
        "args": [str(a) for a in session.config.args],
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "exitstatus": int(exitstatus),
        "wall_s": round(time.time() - session.config._hf_suite_start, 1),  # type: ignore[attr-defined]
        "counts": dict(Counter(t["outcome"] for t in tests.values())),
        "models": {**{f.name: _plain(getattr(STATS, f.name)) for f in dataclasses.fields(STATS)},
                   "built_at_collection": _TESTS.get("<collection>", {}).get("built", 0)},
        "compiled": _compiled_state(),
        "tests": dict(sorted(tests.items())),
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
