"""A verdict names the code it ran (issue 45): no verification vouches for code it did not run.

Each route by which the code a model runs used to differ from the code a verdict was made on:
a class's forward rebound in Python under a bundled type, a same-named class of the user's, a
transformers install edited under the same version, a layer file edited between two processes
that share one cache, classes defined with no source file. Each is verified on the live code
and refused or left unpatched, against the unpatched model's own numbers; stock models are
still served from the manifest as before.

Real tiny transformers models (perturbed weights), real files and subprocesses, the real cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from conftest import own_verdict_cache, tiny_for
from torch import nn

import engine
from engine.errors import SelfVerificationFailed
from engine.foundation.code_identity import code_identity
from engine.releases.code import patched_code

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty verdict cache of this test's own, and no setting from the environment."""
    return own_verdict_cache(tmp_path, monkeypatch)


def _logits(model: nn.Module) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids).logits


def _patched_classes(report: engine.planning.report.Report) -> set[str]:  # type: ignore[name-defined]
    return {d.cls for d in report.decisions if d.action == "patch"}


# --- the identity itself -------------------------------------------------------------------------------------------

def test_identity_follows_a_rebound_forward_and_comes_back_with_the_original() -> None:
    from transformers.models.olmo2 import modeling_olmo2 as m

    stock = code_identity(m.Olmo2RMSNorm)
    with _rebound(m.Olmo2RMSNorm, 1.5):
        assert code_identity(m.Olmo2RMSNorm) != stock
    assert code_identity(m.Olmo2RMSNorm) == stock


def test_classes_with_no_source_file_do_not_collide() -> None:
    """Two classes of one name exec'd from strings (a notebook, ``python -c``): other code, other identity."""
    made = []
    for op in ("+", "-"):
        namespace: dict[str, object] = {"nn": nn}
        source = textwrap.dedent(f"""
            class Norm(nn.Module):
                def forward(self, x, y):
                    return x {op} y
        """)
        exec(source, namespace)  # noqa: S102  (a class with no source file, as a notebook or python -c makes)
        made.append(namespace["Norm"])
    assert code_identity(made[0]) != code_identity(made[1])


def test_a_closure_value_and_a_default_are_part_of_the_identity() -> None:
    def scaled(factor: float):
        def forward(self, x, bias=0.0):
            return x * factor + bias
        return forward

    assert code_identity(scaled(1.0)) != code_identity(scaled(1.01))


def test_the_stock_identity_is_the_source_the_manifest_records_not_the_bytecode() -> None:
    """Stock transformers code is identified by its source (a Python upgrade does not change it)."""
    from transformers.models.qwen3 import modeling_qwen3 as m

    from engine.foundation.code_identity import identity_pieces

    pieces = identity_pieces(m.Qwen3MLP)
    functions = {k: v for k, v in pieces.items() if k.startswith("def ")}
    assert "def Qwen3MLP.forward" in functions and "def Qwen3MLP.__init__" in functions
    assert all(v.startswith("src:") for v in functions.values()), functions


# --- a class changed in Python under a bundled type -----------------------------------------------------------------

@contextlib.contextmanager
def _rebound(cls: type, factor: float) -> Iterator[None]:
    """``cls.forward`` replaced at the class level, as a notebook or another stack's class patch does."""
    original = cls.forward

    def forward(self, hidden_states):
        return original(self, hidden_states) * factor

    cls.forward = forward
    try:
        yield
    finally:
        cls.forward = original


@pytest.mark.parametrize("name", ["qwen3", "llama", "gemma3_text", "olmo2"])
def test_stock_bundled_content_is_still_served_from_the_manifest(name: str) -> None:
    """The manifest's identities are the live ones (regenerate with `python -m engine.commands.matrix code`)."""
    model = tiny_for(name)
    assert engine.plan(model, name).verification.kind == "bundled", engine.plan(model, name).verification
    report = engine.apply(model, name)
    assert report.release is None and report.patched


def test_a_rebound_norm_under_a_bundled_type_is_refused_by_name() -> None:
    from transformers.models.olmo2 import modeling_olmo2 as m

    model = tiny_for("olmo2")
    with _rebound(m.Olmo2RMSNorm, 1.5):
        before = _logits(model)
        the_plan = engine.plan(model, "olmo2")
        assert the_plan.verification.kind == "verify"
        assert "Olmo2RMSNorm" in str(the_plan.verification) and "not the code CI verified" in str(the_plan.verification)
        with pytest.raises(SelfVerificationFailed, match="Olmo2RMSNorm"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine.apply(model, "olmo2")
        assert not engine.is_patched(model)
        assert torch.equal(_logits(model), before)


@pytest.mark.parametrize("choice", [None, "measure"])
def test_a_rebound_norm_under_zero_configuration_is_measured_and_left_unpatched(choice: str | None) -> None:
    from transformers.models.olmo2 import modeling_olmo2 as m

    model = tiny_for("olmo2")
    with _rebound(m.Olmo2RMSNorm, 1.5):
        before = _logits(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = engine.apply(model, choice)
        assert report.zero_config.source == "measured"
        if choice is None:
            assert "Olmo2RMSNorm" in report.zero_config.bundled_misfit
        assert "Olmo2RMSNorm" not in _patched_classes(report)
        assert torch.allclose(_logits(model), before, atol=1e-5, rtol=0)
        engine.revert(model)


# --- a user's own class with transformers' name ---------------------------------------------------------------------

class Qwen3RMSNorm(nn.Module):
    """A user's norm named as transformers' is, computing ``(1 + w) * x_hat`` (Gemma's parameterization)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return ((1.0 + self.weight.float()) * x).to(dtype)


Qwen3RMSNorm.__module__ = "__main__"


def _with_users_norms() -> nn.Module:
    model = tiny_for("qwen3")
    for path, module in list(model.named_modules()):
        if type(module).__name__ == "Qwen3RMSNorm":
            mine = Qwen3RMSNorm(module.weight.shape[0], module.variance_epsilon)
            mine.weight.data.copy_(module.weight.data - 1.0)  # the same scale as before, as (1 + w)
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent), name, mine)
    return model


def test_a_same_named_class_of_the_users_is_not_vouched_for_by_name(tmp_path: Path) -> None:
    model = _with_users_norms()
    before = _logits(model)
    assert "class Qwen3RMSNorm" in patched_code(model, engine.plan(model, "qwen3").patched)
    copy = tmp_path / "my_qwen3.yaml"
    copy.write_text((ROOT / "patchsets" / "qwen3.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    for named in ("qwen3", str(copy)):
        with pytest.raises(SelfVerificationFailed, match="Qwen3RMSNorm"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            engine.apply(model, named)
        assert not engine.is_patched(model)
        assert torch.equal(_logits(model), before)


def test_a_same_named_class_of_the_users_under_zero_configuration_is_measured_as_it_is() -> None:
    model = _with_users_norms()
    before = _logits(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = engine.apply(model)
    assert report.zero_config.source == "measured"
    norms = [line for line in report.zero_config.patched if line.startswith("Qwen3RMSNorm")]
    assert all("one_plus_weight" in line for line in norms), report.zero_config
    assert torch.allclose(_logits(model), before, atol=1e-5, rtol=0)


# --- transformers edited under the same version, and a layer file edited between processes -----------------------

_RUN = """
import json, sys, warnings
import torch
import engine
from engine.tiny import build_tiny_model
model = build_tiny_model("qwen3")
ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    before = model(input_ids=ids).logits
out = {"version": __import__("transformers").__version__, "file": __import__("transformers").__file__}
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = engine.apply(model, sys.argv[1] if len(sys.argv) > 1 else None)
    with torch.no_grad():
        out["diff"] = (model(input_ids=ids).logits - before).abs().max().item()
    out["patched"] = sorted({d.cls for d in report.decisions if d.action == "patch"})
except Exception as exc:
    out["error"] = type(exc).__name__ + ": " + str(exc)[:500]
print(json.dumps(out))
"""


def _run(tmp_path: Path, *args: str, path: str = "") -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (path, str(ROOT)) if p)}
    done = subprocess.run([sys.executable, "-c", _RUN, *args], capture_output=True, text=True, env=env, cwd=tmp_path,
                          check=False,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_edited_transformers_install_under_the_same_version_is_verified_not_vouched_for(tmp_path: Path) -> None:
    """A copy of transformers whose Qwen3RMSNorm computes ``(1 + w) * x``, its version string unchanged."""
    source = Path(transformers.__file__).parent
    copy = tmp_path / "site" / "transformers"
    shutil.copytree(source, copy, ignore=shutil.ignore_patterns("__pycache__"))
    modeling = copy / "models" / "qwen3" / "modeling_qwen3.py"
    text = modeling.read_text(encoding="utf-8")
    stock = "return self.weight * hidden_states.to(input_dtype)"
    assert stock in text
    modeling.write_text(text.replace(stock, "return (1.0 + self.weight) * hidden_states.to(input_dtype)", 1),
                        encoding="utf-8")
    named = _run(tmp_path, "qwen3", path=str(tmp_path / "site"))
    assert named["file"].startswith(str(copy)) and named["version"] == transformers.__version__
    assert named.get("error", "").startswith("SelfVerificationFailed"), named
    zero = _run(tmp_path, path=str(tmp_path / "site"))
    assert "error" not in zero, zero
    assert zero["diff"] < 1e-4, zero  # measured on the edited code: whatever it patched computes what it computes


_PACKAGE = '''
import torch
from torch import nn


class Qwen3RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        dtype = hidden_states.dtype
        x = hidden_states.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (SCALE * x).to(dtype)


def install(model):
    for path, module in list(model.named_modules()):
        if type(module).__name__ == "Qwen3RMSNorm":
            mine = Qwen3RMSNorm(module.weight.shape[0], module.variance_epsilon)
            mine.weight.data.copy_(module.weight.data)
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent), name, mine)
'''

_RUN_PACKAGE = _RUN.replace('model = build_tiny_model("qwen3")\n',
                            'model = build_tiny_model("qwen3")\nimport mylayers\nmylayers.install(model)\n')


def test_a_layer_file_edited_between_two_processes_sharing_a_cache_is_measured_again(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    layer = package / "mylayers.py"
    layer.write_text(_PACKAGE.replace("SCALE", "self.weight"), encoding="utf-8")
    env_path = str(package)
    first = json.loads(subprocess.run(
        [sys.executable, "-c", _RUN_PACKAGE], capture_output=True, text=True, cwd=tmp_path, timeout=600, check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join((env_path, str(ROOT)))}).stdout.strip().splitlines()[-1])
    assert "error" not in first and first["diff"] < 1e-4, first
    layer.write_text(_PACKAGE.replace("SCALE", "(1.0 + self.weight)"), encoding="utf-8")
    second = json.loads(subprocess.run(
        [sys.executable, "-c", _RUN_PACKAGE], capture_output=True, text=True, cwd=tmp_path, timeout=600, check=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join((env_path, str(ROOT)))}).stdout.strip().splitlines()[-1])
    assert "error" not in second and second["diff"] < 1e-4, second  # not the first file's measurement, reused


def test_a_measurement_cached_for_the_stock_class_is_not_reused_once_its_forward_changed() -> None:
    from transformers.models.llama import modeling_llama as m

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = engine.apply(tiny_for("llama"), "measure")
    assert any(line.startswith("LlamaRMSNorm") for line in first.zero_config.patched)
    model = tiny_for("llama")
    with _rebound(m.LlamaRMSNorm, 1.5):
        before = _logits(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            second = engine.apply(model, "measure")
        assert not second.zero_config.measure_cached  # measured again, on the code that runs now
        assert not any(line.startswith("LlamaRMSNorm") for line in second.zero_config.patched)
        assert torch.allclose(_logits(model), before, atol=1e-5, rtol=0)
        engine.revert(model)
