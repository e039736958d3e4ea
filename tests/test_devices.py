"""Device detection, dependency errors, and the device-selection matrix.

The matrix makes dependency availability explicit (``importable`` fixture) instead of
depending on which vendor packages the running venv happens to have, so it states the same
expectations in /work/venv (none installed) and in CI (fla installed).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine.errors import DeviceUnsupported, MissingDependency
from engine.kernels import registry
from engine.kernels.compiled import CompilerRequirement
from engine.kernels.npu import TORCH_NPU
from engine.planning.planner import resolve_kernel
from engine.runtime.devices import as_device, current_device
from engine.schema import (
    Device,
    LinearAttentionPatch,
    OnUnsupported,
    RmsNormPatch,
    RopePatch,
    SwigluPatch,
)

ROOT = Path(__file__).resolve().parent.parent

# ---------------------------------------------------------------- device detection


def test_current_device_on_this_machine_is_cpu() -> None:
    expected = Device.cuda if torch.cuda.is_available() else Device.cpu
    assert current_device() is expected


@pytest.mark.parametrize(
    ("given", "expected"),
    [("cpu", Device.cpu), ("cuda:1", Device.cuda), ("npu", Device.npu), (torch.device("cpu"), Device.cpu),
     (Device.xpu, Device.xpu), ("mps", Device.mps)],
)
def test_as_device_overrides_detection(given, expected) -> None:
    assert as_device(given) is expected


def test_as_device_none_is_current() -> None:
    assert as_device(None) is current_device()


def test_unknown_device_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"unknown device 'tpu'; expected one of cpu, cuda, npu, xpu, mps"):
        as_device("tpu")


def test_device_override_reaches_plan(qwen3) -> None:
    import engine

    plan = engine.plan(qwen3, "qwen3", device="npu")
    assert plan.device is Device.npu
    assert all("for npu" in d.reason for d in plan.patched)


# ---------------------------------------------------------------- dependency errors


def test_missing_dependency_names_package_and_extra() -> None:
    dep = registry.Dependency("no_such_module_xyz", "no-such-package", "npu")
    with pytest.raises(MissingDependency) as info:
        dep.check()
    assert str(info.value) == (
        "no-such-package is not installed (import 'no_such_module_xyz' failed); pip install \"patch-engine[npu]\""
    )


@pytest.mark.skipif("torch_npu" in sys.modules, reason="torch_npu is importable here")
def test_torch_npu_missing_names_the_npu_extra() -> None:
    import importlib.util

    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here")
    with pytest.raises(MissingDependency, match=r'torch-npu is not installed .*pip install "patch-engine\[npu\]"'):
        TORCH_NPU.check()


BROKEN_NPU_SCRIPT = textwrap.dedent(
    """
    import json
    import torch
    import engine
    from engine.runtime.devices import current_device
    from engine.errors import MissingDependency
    from engine.kernels.npu import TORCH_NPU
    from engine.planning.planner import resolve_kernel
    from engine.schema import Device, OnUnsupported, RmsNormPatch
    out = {"device": current_device().value}
    try:
        TORCH_NPU.check()
    except MissingDependency as exc:
        out["error"] = str(exc)
    patch = RmsNormPatch(target="X", op="rms_norm", scale="weight")
    provider, reason = resolve_kernel("rms_norm", "auto", Device.npu, "training", OnUnsupported.error, patch=patch)
    out["auto_on_npu"], out["auto_reason"] = provider.name, reason
    provider, _ = resolve_kernel("rms_norm", "auto", current_device(), "training", OnUnsupported.error, patch=patch)
    out["auto_here"] = provider.name
    x = torch.randn(2, 8)
    out["cpu_math"] = bool(torch.isfinite(provider.build(patch)(x, torch.ones(8), 1e-6)).all())
    try:
        resolve_kernel("rms_norm", "npu", Device.npu, "training", OnUnsupported.error, patch=patch)
    except MissingDependency as exc:
        out["explicit"] = type(exc).__name__
    print(json.dumps(out))
    """
)


def test_broken_torch_npu_is_explained_and_cpu_still_works(tmp_path: Path) -> None:
    """An installed torch_npu without CANN: the engine's CPU use is unaffected; the npu error says why.

    A fake ``torch_npu`` package whose import fails as the real one does without the CANN
    toolkit (measured: ``ImportError: libhccl.so: cannot open shared object file``), first on
    ``sys.path`` of a fresh interpreter. (transformers 5.24 itself is not immune: its
    ``is_torch_npu_available`` imports torch_npu without catching the error, so building a
    model there fails inside transformers; docs/devices.md says to uninstall torch-npu.)
    """
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('libhccl.so: cannot open shared object file')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-c", BROKEN_NPU_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import json

    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["device"] == "cpu"
    assert out["error"].startswith(
        "torch-npu is installed but `import torch_npu` failed: ImportError: libhccl.so: cannot open shared object file."
    )
    assert "CANN" in out["error"]
    assert out["auto_on_npu"] == "torch"  # auto passes the broken npu kernel over...
    assert "libhccl.so" in out["auto_reason"]  # ...and says why
    assert out["auto_here"] == "torch" and out["cpu_math"] is True
    assert out["explicit"] == "MissingDependency"


# ---------------------------------------------------------------- the selection matrix

PATCHES = {
    "rms_norm": RmsNormPatch(target="X", op="rms_norm", scale="weight"),
    "swiglu": SwigluPatch(target="X", op="swiglu"),
    "rope": RopePatch(op="rope"),
    "linear_attention": LinearAttentionPatch(op="linear_attention", function="f", form="chunk"),
}
VENDOR_MODULES = {"torch_npu", "liger_kernel", "fla", "torch._inductor"}  # the last: compiled's C++ compiler


@pytest.fixture
def importable(monkeypatch: pytest.MonkeyPatch):
    """Declare which vendor modules import: ``importable({"fla"})``."""

    def declare(modules: set[str]) -> None:
        def check(self: registry.Dependency) -> None:
            if self.module not in modules:
                raise MissingDependency(f"{self.package} is not installed (declared by the test)")

        monkeypatch.setattr(registry.Dependency, "check", check)
        monkeypatch.setattr(CompilerRequirement, "check", check)

    return declare


#: auto's pick per (op, device) with every vendor package importable / with none.
AUTO_ALL = {
    "rms_norm": {"cpu": "compiled", "cuda": "liger", "npu": "npu"},
    "swiglu": {"cpu": "compiled", "cuda": "liger", "npu": "npu"},
    "rope": {"cpu": "torch", "cuda": "liger", "npu": "npu"},
    "linear_attention": {"cpu": "torch", "cuda": "fla", "npu": "fla"},
}
AUTO_NONE = {op: {"cpu": "torch", "cuda": "torch", "npu": "torch"} for op in AUTO_ALL}
DEVICES = ("cpu", "cuda", "npu")


@pytest.mark.parametrize("mode", ["training", "inference"])
@pytest.mark.parametrize(("available", "table"), [(VENDOR_MODULES, AUTO_ALL), (set(), AUTO_NONE)],
                         ids=["all-installed", "none-installed"])
def test_auto_matrix(importable, available, table, mode) -> None:
    importable(available)
    got = {
        op: {dev: resolve_kernel(op, "auto", Device(dev), mode, OnUnsupported.error, patch=PATCHES[op])[0].name
             for dev in DEVICES}
        for op in PATCHES
    }
    assert got == table


def _explicit_cases():
    for op in PATCHES:
        for provider in registry.providers_for(op):
            if provider.name == "torch":
                continue
            for dev in DEVICES:
                yield op, provider.name, dev


@pytest.mark.parametrize(("op", "kernel", "device"), list(_explicit_cases()))
def test_explicit_kernel_policies(importable, op: str, kernel: str, device: str) -> None:
    """What error / skip / fallback do with an explicit kernel, on every device, packages present."""
    importable(VENDOR_MODULES)
    provider = registry.get(kernel, op)
    dev = Device(device)
    patch = PATCHES[op]
    if dev in provider.devices:
        for policy in OnUnsupported:
            chosen, reason = resolve_kernel(op, kernel, dev, "training", policy, patch=patch)
            # a provider with a measured rule (compiled: where it runs compiled) says so after the choice
            note = f" ({provider.rule_note()})" if provider.rule_note is not None else ""
            assert chosen is provider and reason == f"{kernel} (declared){note}"
        return
    message = f"{kernel} requires {provider.device_list()}, current accelerator is {device}."
    with pytest.raises(DeviceUnsupported) as info:
        resolve_kernel(op, kernel, dev, "training", OnUnsupported.error, patch=patch)
    assert str(info.value) == message
    chosen, reason = resolve_kernel(op, kernel, dev, "training", OnUnsupported.skip, patch=patch)
    assert chosen is None and reason == f"skipped: {message}"
    chosen, reason = resolve_kernel(op, kernel, dev, "training", OnUnsupported.fallback, patch=patch)
    assert chosen is registry.get("torch", op) and reason == f"fallback to torch: {message}"


def test_fla_message_is_the_documented_one() -> None:
    with pytest.raises(DeviceUnsupported, match=r"^fla requires cuda or npu, current accelerator is cpu\.$"):
        resolve_kernel("linear_attention", "fla", Device.cpu, "training", OnUnsupported.error)


@pytest.mark.parametrize("policy", list(OnUnsupported))
def test_explicit_kernel_with_missing_package(importable, policy: OnUnsupported) -> None:
    """On its own device, a kernel whose package is missing follows on_unsupported too."""
    importable(set())
    if policy is OnUnsupported.error:
        with pytest.raises(MissingDependency):
            resolve_kernel("rms_norm", "liger", Device.cuda, "training", policy)
        return
    chosen, reason = resolve_kernel("rms_norm", "liger", Device.cuda, "training", policy)
    assert (chosen.name if chosen else None) == ("torch" if policy is OnUnsupported.fallback else None)
    assert "declared by the test" in reason


def test_auto_passes_over_a_kernel_that_cannot_reproduce_the_declaration(importable) -> None:
    """liger's output dtype cannot express (1 + w) in the llama order: auto takes torch and says why."""
    importable(VENDOR_MODULES)
    patch = RmsNormPatch(target="X", op="rms_norm", scale="one_plus_weight", cast="llama")
    chosen, reason = resolve_kernel("rms_norm", "auto", Device.cuda, "training", OnUnsupported.error, patch=patch)
    assert chosen.name == "torch" and "liger: scale one_plus_weight with cast llama" in reason
    with pytest.raises(DeviceUnsupported, match="liger cannot compute rms_norm as declared"):
        resolve_kernel("rms_norm", "liger", Device.cuda, "training", OnUnsupported.error, patch=patch)


def test_importing_the_engine_imports_no_vendor_package() -> None:
    code = "import sys, engine, engine.kernels; print(sorted(m for m in ('torch_npu', 'liger_kernel', 'fla', 'triton') if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          check=True)
    assert proc.stdout.strip().splitlines()[-1] == "[]"
