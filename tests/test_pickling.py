"""Issue 11, scenario 9: a patched model pickles whole and comes back patched.

``torch.save(model)`` of a patched model raised ``PicklingError`` (a lambda in the swiglu
provider, and the forwards were closures). Installed forwards now pickle as data (op, patch
settings, kernel name) and are rebuilt from the registry on load; the loaded model is
patched, computes what the saved one did, and reverts exactly. Compared in fp32 with the
unpatched model (logits, loss and every gradient within 1e-5).
"""

from __future__ import annotations

import copy
import gc
import io
import pickle
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest
import torch
from conftest import ROOT, tiny_for
from training_helpers import grads, max_diff

import engine
from engine.patching.bound_forward import PatchedForward
from engine.runtime import routing

TOL = 1e-5


def _torch_roundtrip(model: torch.nn.Module) -> torch.nn.Module:
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


ROUNDTRIPS: dict[str, Callable[[torch.nn.Module], torch.nn.Module]] = {
    "torch.save": _torch_roundtrip,
    "pickle": lambda m: pickle.loads(pickle.dumps(m)),
    "deepcopy": copy.deepcopy,
}


def _numbers(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with engine.torch_path(model):  # a no-op unless fla is installed (then: the torch delta rule on CPU)
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), grads(model)


def _assert_same_numbers(a, b) -> None:  # type: ignore[no-untyped-def]
    assert (a[0] - b[0]).abs().max().item() <= TOL
    assert abs(a[1].item() - b[1].item()) <= TOL
    assert max_diff(a[2], b[2]) <= TOL


@pytest.mark.parametrize("how", list(ROUNDTRIPS))
@pytest.mark.parametrize("family", ["qwen3", "qwen3_next"])
def test_patched_model_roundtrips_patched_with_the_same_numbers(family: str, how: str) -> None:
    reference = tiny_for(family)
    model = copy.deepcopy(reference)
    report = engine.apply(model, family, device="cpu", mode="training")
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    loaded = ROUNDTRIPS[how](model)
    try:
        assert engine.is_patched(loaded)
        assert engine.patching.patcher.applied_report(loaded).patched == report.patched  # type: ignore[union-attr]
        patched_paths = [p for p in report.patched if "." in p and not p.startswith("transformers.")]
        modules = dict(loaded.named_modules())
        for path in patched_paths:
            assert isinstance(modules[path].__dict__.get("forward"), PatchedForward), path
        _assert_same_numbers(_numbers(loaded, ids), _numbers(reference, ids))
        _assert_same_numbers(_numbers(model, ids), _numbers(reference, ids))
        assert engine.revert(loaded) is True
        assert all("forward" not in m.__dict__ for m in loaded.modules())  # exactly as before patching
        _assert_same_numbers(_numbers(loaded, ids), _numbers(reference, ids))
    finally:
        engine.revert(loaded)
        engine.revert(model)
    sites = [(d.site.namespace, d.site.function) for d in report.decisions if d.site is not None]
    # Patched models of earlier tests that sit in reference cycles release their routers when the
    # cyclic GC collects them; collect now so that only this test's models count.
    gc.collect()
    assert sites and all(routing.router_for(*site) is None for site in sites), "a router outlived its models"


def test_a_patched_submodule_pickles_alone_and_rebuilds_at_its_first_call() -> None:
    model = tiny_for("qwen3")
    engine.apply(model, "qwen3", device="cpu")
    try:
        norm, mlp = model.model.layers[0].post_attention_layernorm, model.model.layers[0].mlp
        x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
        for module in (norm, mlp):
            loaded = pickle.loads(pickle.dumps(module))
            assert isinstance(loaded.__dict__["forward"], PatchedForward)
            with torch.no_grad():
                assert (loaded(x) - module(x)).abs().max().item() == 0
                assert (loaded(x) - type(module).forward(module, x)).abs().max().item() <= TOL
    finally:
        engine.revert(model)


def test_a_model_saved_patched_loads_patched_in_a_fresh_process(tmp_path) -> None:
    reference = tiny_for("qwen3")
    model = copy.deepcopy(reference)
    engine.apply(model, "qwen3", device="cpu")
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits
    torch.save(model, tmp_path / "model.pt")
    torch.save(ids, tmp_path / "ids.pt")
    engine.revert(model)
    script = textwrap.dedent(f"""
        import torch, engine
        from engine.patching.patcher import applied_report
        model = torch.load({str(tmp_path / "model.pt")!r}, weights_only=False)
        ids = torch.load({str(tmp_path / "ids.pt")!r})
        assert engine.is_patched(model)
        with torch.no_grad():
            torch.save(model(input_ids=ids).logits, {str(tmp_path / "logits.pt")!r})
        print(sorted({{d.kernel for d in applied_report(model).decisions}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (torch.load(tmp_path / "logits.pt") - expected).abs().max().item() <= TOL
