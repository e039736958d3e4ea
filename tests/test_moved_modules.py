"""Nothing a user wrote breaks when the engine's modules move: old import paths, and a model pickled before.

Every old module path (``engine.foundation.moved.MOVED``) imports as THE SAME module object as its
new path, with one DeprecationWarning per path and process that names the new path.

``tests/fixtures/premove_patched_qwen3.pt`` is a tiny patched Qwen3 saved whole (``torch.save(model)``)
by the engine before its modules moved into layer packages (made by
``tests/fixtures/make_premove_pickle.py``); its pickle names the old module paths. Loaded by today's
engine it must be patched, compute the unpatched model's numbers (fp32, 1e-5), train (a backward),
and revert exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import torch

import engine
from engine.foundation.moved import MOVED

ROOT = Path(__file__).resolve().parent.parent

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "premove_patched_qwen3.pt"
TOL = 1e-5


def _load_premove() -> tuple[dict, list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        saved = torch.load(FIXTURE, weights_only=False)
    return saved, list(caught)


def _with_this_releases_instance_state(model: torch.nn.Module) -> torch.nn.Module:
    """Give a model pickled under an older transformers the per-instance state this release's classes expect.

    Since transformers 5.25 (with HF ``kernels``, now its dependency) each attention module keeps
    a private copy of its kernelized functions (``_kernel_funcs``, set in ``__init__``); a model
    pickled before has none, patched or not, and its attention fails with ``AttributeError``. That
    is transformers' cross-release pickle limit, not this test's subject (the engine's old module
    paths): copied here from a fresh model of the same config, built by this release.
    """
    from transformers import AutoModelForCausalLM

    fresh = dict(AutoModelForCausalLM.from_config(model.config).named_modules())
    for name, module in model.named_modules():
        twin = fresh.get(name)
        if twin is not None and "_kernel_funcs" in twin.__dict__ and "_kernel_funcs" not in module.__dict__:
            module.__dict__["_kernel_funcs"] = twin.__dict__["_kernel_funcs"]
    return model


def test_a_model_pickled_before_the_move_loads_patched_and_computes_the_unpatched_numbers() -> None:
    saved, caught = _load_premove()
    model, ids = _with_this_releases_instance_state(saved["model"]), saved["input_ids"]
    assert engine.is_patched(model)
    deprecations = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    assert all("moved to" in message for message in deprecations), deprecations
    out = model(input_ids=ids, labels=ids)
    assert (out.logits.detach() - saved["unpatched_logits"]).abs().max().item() <= TOL
    assert abs(out.loss.item() - saved["unpatched_loss"].item()) <= TOL
    out.loss.backward()
    patched_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert patched_grads and all(g.isfinite().all() for g in patched_grads.values())

    assert engine.revert(model) is True
    assert all("forward" not in m.__dict__ for m in model.modules())
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    assert (out.logits.detach() - saved["unpatched_logits"]).abs().max().item() <= TOL
    out.loss.backward()
    for name, grad in patched_grads.items():  # the patched backward was the unpatched one's
        assert (grad - dict(model.named_parameters())[name].grad).abs().max().item() <= TOL, name


_IMPORT_EVERY_OLD_PATH = """
import importlib, json, sys, warnings
import engine
from engine.foundation.moved import MOVED

out = {}
for old, new in MOVED.items():
    with warnings.catch_warnings(record=True) as first:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    with warnings.catch_warnings(record=True) as again:
        warnings.simplefilter("always")
        importlib.import_module(old)
    out[old] = {
        "same": module is importlib.import_module(new) and sys.modules[old] is sys.modules[new],
        "name": module.__name__, "spec": module.__spec__.name,
        "first": [(w.category.__name__, str(w.message)) for w in first],
        "again": len(again),
    }
print(json.dumps(out))
"""


def test_every_old_module_path_imports_as_the_same_module_and_warns_once() -> None:
    done = subprocess.run([sys.executable, "-c", _IMPORT_EVERY_OLD_PATH], check=False, cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert set(found) == set(MOVED)
    for old, new in MOVED.items():
        got = found[old]
        assert got["same"] and got["name"] == got["spec"] == new, (old, got)
        moved = [m for c, m in got["first"] if c == "DeprecationWarning" and f"{old} moved to {new}" in m]
        assert len(moved) == 1, (old, got["first"])
        assert got["again"] == 0, old


def test_old_paths_name_no_file_and_new_paths_exist() -> None:
    for old, new in MOVED.items():
        assert not (ROOT / (old.replace(".", "/") + ".py")).exists(), old
        assert any((ROOT / new.replace(".", "/")).with_suffix(s).exists() for s in (".py", "")), new


def test_an_old_path_is_the_new_module_for_isinstance_and_monkeypatching(monkeypatch) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import engine.planner as old_planner
        from engine.planner import Plan

        from engine.planning import decisions, planner
    assert Plan is planner.Plan is decisions.Plan and old_planner is planner
    monkeypatch.setattr(old_planner, "resolve_kernel", "patched")
    assert planner.resolve_kernel == "patched"


def test_python_dash_m_runs_a_command_module_by_its_old_path() -> None:
    done = subprocess.run([sys.executable, "-m", "engine.matrix", "--help"], check=False, cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert "render" in done.stdout and "run" in done.stdout


def test_an_old_path_reached_as_an_attribute_warns_at_the_line_that_wrote_it() -> None:
    code = """
import warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import engine
    from engine import routing
    from engine.runtime import routing as new
assert routing is new
print([(w.category.__name__, w.filename, w.lineno) for w in caught])
"""
    done = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[('DeprecationWarning', '<string>', 6)]"
