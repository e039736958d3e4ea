"""Launcher integrations without their framework installed: our ``MissingDependency``, naming what to install.

LlamaFactory and twinkle each live in their own venv (``.ci/llamafactory``, ``.ci/twinkle``);
here, in the main venv, they are absent, which is the case a user meets first. Each test skips
where the package is installed (there the real integration tests run instead).

And the opposite case, a stack installed whose import fails inside (a broken dependency): the error
must name that import and its package, never "pip install" the stack. Stand-in distributions
written to a folder on ``sys.path`` play the stack and the broken dependency
(``engine.integrations.stack_import`` is what every integration imports its stack with);
tests/test_llamafactory_v1.py runs the real LlamaFactory beside a broken torchvision.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from conftest import ROOT
from stack_helpers import write_distribution

from engine.errors import MissingDependency

no_llamafactory = pytest.mark.skipif(importlib.util.find_spec("llamafactory") is not None,
                                     reason="LlamaFactory is installed here: tests/test_llamafactory_v1.py runs")
no_twinkle = pytest.mark.skipif(importlib.util.find_spec("twinkle") is not None,
                                reason="twinkle is installed here: tests/test_twinkle.py runs")


@no_llamafactory
def test_llamafactory_launcher_names_the_package_to_install(tmp_path) -> None:
    """``python -m engine.integrations.llamafactory sft cfg.yaml``: one line saying what to install, no traceback."""
    config = tmp_path / "cfg.yaml"
    config.write_text("model: Qwen/Qwen3-0.6B\nkernel_config: {name: patch_engine, patchset: qwen3}\n")
    proc = subprocess.run([sys.executable, "-m", "engine.integrations.llamafactory", "sft", str(config)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert proc.returncode != 0
    assert "MissingDependency" in proc.stderr and 'pip install "llamafactory==0.9.5"' in proc.stderr, proc.stderr


@no_llamafactory
def test_llamafactory_plugin_registration_names_the_package() -> None:
    from engine.integrations import llamafactory

    with pytest.raises(MissingDependency, match=r"LlamaFactory 0\.9\.5 or later .*pip install \"llamafactory==0\.9\.5\""):
        llamafactory.register()


@no_twinkle
def test_twinkle_patch_names_the_package_to_install() -> None:
    """The module imports (nothing of twinkle is needed for that); the patch class is what needs twinkle."""
    from engine.integrations import twinkle

    with pytest.raises(MissingDependency, match=r"twinkle-kit.*pip install \"twinkle-kit==0\.5\.1\""):
        twinkle.PatchsetPatch  # noqa: B018  (the attribute access is the point)
    with pytest.raises(MissingDependency, match="twinkle-kit"):
        twinkle.kernel_mapping("qwen3")
    with pytest.raises(ImportError, match="twinkle-kit"):  # what `from ... import PatchsetPatch` shows
        from engine.integrations.twinkle import PatchsetPatch  # noqa: F401


# --- installed, but broken: the error names the import that failed, never "install X" ----------------------


@pytest.fixture
def site(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """A folder on ``sys.path`` for stand-in distributions; the modules they import are forgotten after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        if name.split(".")[0] in ("stack", "brokendep"):
            del sys.modules[name]


def _stack(site, *, stack_source: str = "import brokendep\n") -> None:
    """``stack`` 1.2 (its ``v1`` imports ``brokendep``) and ``brokendep`` 0.3, which raises as a CUDA torchvision
    beside a CPU torch does (``torch.library`` refusing its ops)."""
    write_distribution(site, "stack", "1.2", {"stack/__init__.py": "", "stack/v1.py": stack_source})
    write_distribution(site, "brokendep", "0.3", {
        "brokendep/__init__.py": "from . import _meta_registrations\n",
        "brokendep/_meta_registrations.py": "raise RuntimeError('operator brokendep::nms does not exist')\n",
    })


def _import(module: str):
    from engine.integrations.stack_import import import_stack_module

    return import_stack_module(module, who="the stack integration", needs="stack 1.2 or later",
                               install='pip install "stack==1.2"')


def test_a_stack_not_installed_gets_the_pip_line(site) -> None:
    with pytest.raises(MissingDependency, match=r"needs stack 1\.2 or later \(stack\.v1\): pip install \"stack==1\.2\""):
        _import("stack.v1")


def test_a_stack_too_old_gets_the_pip_line_and_the_installed_version(site) -> None:
    write_distribution(site, "stack", "1.1", {"stack/__init__.py": ""})  # no stack.v1 yet
    with pytest.raises(MissingDependency, match=r"\(stack\.v1; installed: stack 1\.1\): pip install \"stack==1\.2\""):
        _import("stack.v1")


def test_a_broken_dependency_is_named_not_the_installed_stack(site) -> None:
    """Before: ``needs stack 1.2 or later (stack.v1): pip install "stack==1.2" (RuntimeError: ...)``, for an installed stack."""
    _stack(site)
    with pytest.raises(MissingDependency) as info:
        _import("stack.v1")
    message = str(info.value)
    assert "pip install" not in message, message
    assert ("importing stack.v1 failed in brokendep._meta_registrations (brokendep 0.3): RuntimeError: operator "
            "brokendep::nms does not exist; stack 1.2 is installed") in message, message


def test_a_wrapped_import_error_is_traced_to_its_first_cause(site) -> None:
    """transformers' lazy module turns the failure into ``Could not import module 'set_seed'`` (what LlamaFactory
    v1 showed): the message still names the module that raised, and quotes the wrapper."""
    _stack(site, stack_source=(
        "try:\n    import brokendep\nexcept RuntimeError as e:\n"
        "    raise ModuleNotFoundError(\"Could not import module 'set_seed'. Are this object's requirements defined "
        "correctly?\") from e\n"))
    with pytest.raises(MissingDependency) as info:
        _import("stack.v1")
    message = str(info.value)
    assert "pip install" not in message, message
    assert "failed in brokendep._meta_registrations (brokendep 0.3): RuntimeError: operator brokendep::nms" in message
    assert "(reported as ModuleNotFoundError: Could not import module 'set_seed'" in message, message


def test_a_dependency_not_installed_is_named_with_its_importer(site) -> None:
    _stack(site, stack_source="import notinstalled_dep\n")
    with pytest.raises(MissingDependency) as info:
        _import("stack.v1")
    message = str(info.value)
    assert ("importing stack.v1 failed: module 'notinstalled_dep' is not installed (imported by stack.v1, stack 1.2); "
            "stack 1.2 is installed: install the module named here") in message, message
    assert 'pip install "stack==1.2"' not in message, message
