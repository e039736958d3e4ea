"""Launcher integrations without their framework installed: our ``MissingDependency``, naming what to install.

LlamaFactory and twinkle each live in their own venv (``.ci/llamafactory``, ``.ci/twinkle``);
here, in the main venv, they are absent, which is the case a user meets first. Each test skips
where the package is installed (there the real integration tests run instead).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
from conftest import ROOT

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
