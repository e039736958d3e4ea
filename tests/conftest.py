"""Shared fixtures: tiny models of each bundled family, and a snapshot of 'exactly as before'."""

from __future__ import annotations

import gc
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

# The core suite checks bit-exactness against transformers, which the torch references give and
# compiled (inductor) kernels do not (they reduce in another order); compiling would also cost CI
# minutes. So `auto` picks torch here; tests/test_compiled.py re-enables compiled kernels.
os.environ.setdefault("PATCH_ENGINE_COMPILE", "0")
# The audit's conditions of use (engine/_data/conditions.yaml) rerun the model under each condition for every
# patch judged: the audit tests that judge other things run the probe alone, and tests/test_audit_conditions.py
# names the conditions it judges.
os.environ.setdefault("PATCH_ENGINE_AUDIT_CONDITIONS", "none")
# verify, apply's self-verification and zero configuration: the probe only (each condition reruns the model; the
# conditions' own tests, tests/test_conditions*.py, name theirs, and CI's verify-all step runs the budget's)
os.environ.setdefault("PATCH_ENGINE_CONDITIONS", "none")
# Self-verification verdicts (engine/releases) go to a cache of this session's own, never the user's
# ~/.cache: a test must not read a verdict another run left, nor leave one behind.
os.environ.setdefault("PATCH_ENGINE_CACHE_DIR", tempfile.mkdtemp(prefix="patch-engine-test-cache-"))

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine.loader import bundled_names, load_patchset
from engine.tiny import build_tiny_model


def tiny_for(name: str, *, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A tiny, perturbed model of the family a bundled patchset is for."""
    ps = load_patchset(name)
    tiny = ps.tiny_model
    model_type = (tiny.model_type if tiny and tiny.model_type else None) or ps.model_types[0]
    config = {**(tiny.config if tiny else {}), **overrides}
    return build_tiny_model(model_type, config, dtype=dtype, seed=seed, random_buffers=tiny.random_buffers if tiny else None)


def own_verdict_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty verdict cache of the calling test's own, and no ``unverified`` setting from the environment."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("PATCH_ENGINE_CACHE_DIR", str(folder))
    for name in ("PATCH_ENGINE_UNVERIFIED", "PATCH_ENGINE_UNVERIFIED_RELEASE"):
        monkeypatch.delenv(name, raising=False)
    return folder


@pytest.fixture
def qwen3() -> torch.nn.Module:
    return tiny_for("qwen3")


@pytest.fixture(scope="session")
def bundled() -> list[str]:
    return bundled_names()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip device-marked tests where the device is absent (HF kernels' convention)."""
    has_cuda = torch.cuda.is_available()
    has_npu = hasattr(torch, "npu") and torch.npu.is_available()  # type: ignore[attr-defined]
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        if "npu" in item.keywords and not has_npu:
            item.add_marker(pytest.mark.skip(reason="needs an Ascend NPU"))


@pytest.fixture
def torch_npu(monkeypatch: pytest.MonkeyPatch):
    """An emulated ``torch_npu`` (tests/npu_emulator.py: the documented contracts of its ops).

    The emulated NPU counts as present for apply's device check (tensors stay on the CPU). Not by
    faking ``torch.npu``: transformers would then route attention to torch_npu's flash attention.
    """
    from npu_emulator import make_torch_npu

    from engine.runtime import devices
    from engine.schema import Device

    module = make_torch_npu()
    monkeypatch.setitem(sys.modules, "torch_npu", module)
    present = devices.is_present
    monkeypatch.setattr(devices, "is_present", lambda device: device is Device.npu or present(device))
    return module


@pytest.fixture(autouse=True, scope="module")
def _collect_patched_models_between_modules():
    """Patched models a test module leaves unreverted release their function routers on GC.

    Why: a patched model holds reference cycles (its installed forwards refer to their
    modules), so dropping it frees it only when the cyclic collector runs. Until then the
    shared router it acquired stays installed, and a later module that counts routers (or
    captures the module-level function as "the original") sees another module's leftovers.
    Collecting once per module keeps modules independent of their order, at ~0.1 s each.
    """
    yield
    gc.collect()
