"""Bad inputs: each is a clear error of our own type, and the model is left exactly as it was."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
import torch
from snapshots import assert_same, snapshot

import engine
from engine.kernels import registry

GOOD = """\
name: mine
model_types: [qwen3]
patches:
  - target: Qwen3RMSNorm
    op: rms_norm
    scale: weight
  - target: Qwen3MLP
    op: swiglu
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mine.yaml"
    path.write_text(textwrap.dedent(text))
    return path


CASES = {
    "malformed yaml": (GOOD.replace("    scale: weight", "    scale: [weight"), engine.PatchsetError, r"mine\.yaml:\d+: "),
    "unknown key": (GOOD.replace("scale: weight", "scael: weight"), engine.PatchsetError,
                    r"mine\.yaml:6: patches\[0\]\.scael: unknown key 'scael'; did you mean 'scale'\?"),
    "wrong enum": (GOOD.replace("scale: weight", "scale: one_plus_weigth"), engine.PatchsetError,
                   r"mine\.yaml:6: patches\[0\]\.scale: 'one_plus_weigth' is not one of 'weight', 'one_plus_weight'"),
    "missing op": (GOOD.replace("    op: swiglu\n", ""), engine.PatchsetError, r"mine\.yaml:7: patches\[1\].*missing required key 'op'"),
    "unknown kernel": (GOOD.replace("op: swiglu", "op: swiglu\n    kernel: nosuch"), engine.PatchsetError,
                       r"mine\.yaml:9: patches\[1\]\.kernel: unknown kernel 'nosuch'; known kernels: auto, .*torch"),
    "other model type": (GOOD.replace("[qwen3]", "[llama]"), engine.ModelTypeMismatch,
                         r"patchset 'mine' is for model_type llama; this model \(Qwen3ForCausalLM\) is 'qwen3'"),
    "target not in model": (GOOD.replace("Qwen3MLP", "Qwen3Mlp"), engine.TargetNotFound,
                            r"targets class 'Qwen3Mlp', which matches no module of Qwen3ForCausalLM; did you mean 'Qwen3MLP'\?"),
    "plain op on a module with a different forward": (GOOD.replace("Qwen3MLP", "Qwen3Attention"), engine.SignatureMismatch,
                                                      r"swiglu cannot replace Qwen3Attention\.forward\("),
    "wrong eps attribute": (GOOD.replace("scale: weight", "scale: weight\n    eps_attr: eps"), engine.SignatureMismatch,
                            r"Qwen3RMSNorm has no numeric attribute 'eps' \(eps_attr\); numeric attributes it has: variance_epsilon"),
    # outside the range, the default policy verifies on this release: a wrong declaration is refused with the finding
    "transformers out of range, wrong declaration": (
        GOOD.replace("scale: weight", "scale: one_plus_weight") + "requires: {transformers: '<5'}\n",
        engine.ReleaseVerificationFailed, r"verified on transformers<5; installed is 5\..*declared scale: one_plus_weight"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_a_clear_error_and_the_model_is_untouched(case: str, qwen3: torch.nn.Module, tmp_path: Path) -> None:
    text, error, pattern = CASES[case]
    path = _write(tmp_path, text)
    before = snapshot(qwen3)
    with pytest.raises(error, match=re.compile(pattern, re.DOTALL)) as info:
        engine.apply(qwen3, str(path), device="cpu")
    assert isinstance(info.value, engine.PatchError)
    assert_same(before, snapshot(qwen3))
    assert not engine.is_patched(qwen3)


@pytest.fixture
def cuda_only_kernel():
    provider = registry.register(registry.KernelProvider(
        name="gpuonly", op="rms_norm", devices=frozenset({registry.Device.cuda, registry.Device.npu}),
        build=lambda patch: (_ for _ in ()).throw(AssertionError("must not be built"))))
    yield provider
    registry.unregister("gpuonly", "rms_norm")


def _with_kernel(policy: str) -> dict:
    ps = engine.load_patchset("qwen3").model_dump(mode="json")
    ps["on_unsupported"] = policy
    ps["patches"][0]["kernel"] = "gpuonly"
    return ps


def test_device_unsupported_names_the_current_accelerator(qwen3, cuda_only_kernel) -> None:
    before = snapshot(qwen3)
    with pytest.raises(engine.DeviceUnsupported, match=r"^gpuonly requires cuda or npu, current accelerator is cpu\.$"):
        engine.apply(qwen3, _with_kernel("error"), device="cpu")
    assert_same(before, snapshot(qwen3))


def test_on_unsupported_skip_and_fallback(qwen3, cuda_only_kernel) -> None:
    report = engine.apply(qwen3, _with_kernel("skip"), device="cpu")
    norms = [d for d in report.decisions if d.cls == "Qwen3RMSNorm"]
    assert norms and all(d.action == "skip" and "current accelerator is cpu" in d.reason for d in norms)
    assert "forward" not in qwen3.model.norm.__dict__
    engine.revert(qwen3)
    report = engine.apply(qwen3, _with_kernel("fallback"), device="cpu")
    norms = [d for d in report.decisions if d.cls == "Qwen3RMSNorm"]
    assert all(d.action == "patch" and d.kernel == "torch" and d.reason.startswith("fallback to torch") for d in norms)
    assert engine.verify(qwen3).passed
    engine.revert(qwen3)


def test_explicit_kernel_on_its_device_is_planned(qwen3, cuda_only_kernel) -> None:
    the_plan = engine.plan(qwen3, _with_kernel("error"), device="cuda")
    assert {d.kernel for d in the_plan.patched if d.cls == "Qwen3RMSNorm"} == {"gpuonly"}


def test_missing_dependency_names_package_and_extra(qwen3) -> None:
    dep = registry.Dependency(module="surely_not_installed_pkg", package="surely-not-installed", extra="cuda")
    registry.register(registry.KernelProvider(name="needsdep", op="swiglu", devices=registry.ALL_DEVICES,
                                              build=lambda patch: None, requires=(dep,)))
    try:
        ps = engine.load_patchset("qwen3").model_dump(mode="json")
        ps["patches"][1]["kernel"] = "needsdep"
        before = snapshot(qwen3)
        with pytest.raises(engine.MissingDependency,
                           match=r'surely-not-installed is not installed .*pip install "patch-engine\[cuda\]"'):
            engine.apply(qwen3, ps, device="cpu")
        assert_same(before, snapshot(qwen3))
    finally:
        registry.unregister("needsdep", "swiglu")


def test_unknown_device_is_a_usage_error(qwen3) -> None:
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        engine.plan(qwen3, "qwen3", device="tpu")


def test_duplicate_registration_is_refused() -> None:
    with pytest.raises(ValueError, match="already registered"):
        registry.register(registry.get("torch", "rms_norm"))


@pytest.mark.parametrize(("offload", "says"), [("bogus", "is not a place to keep what verification compares"),
                                               ("cuda", "this machine has no cuda device"),
                                               ("cuda:7", "this machine has no cuda device")])
def test_a_bad_offload_is_our_clear_error_naming_it_and_the_model_is_untouched(qwen3, offload, says) -> None:
    """torch's own answers were ``Expected one of cpu, cuda, ...`` and ``Torch not compiled with CUDA enabled``."""
    if offload.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    before = snapshot(qwen3)
    pattern = (rf"verify\(offload={offload!r}\).*{says}.*'auto' \(default\), 'host', 'none', or a device of this "
               r"machine \(present: cpu")
    with pytest.raises(engine.InvalidArgument, match=pattern):
        engine.verify(qwen3, "qwen3", offload=offload)
    assert_same(before, snapshot(qwen3))
    assert not engine.is_patched(qwen3)
    engine.apply(qwen3, "qwen3", device="cpu")  # and on a model patched before: it stays patched, as it was
    with pytest.raises(engine.InvalidArgument, match=pattern):
        engine.verify(qwen3, offload=offload)
    assert engine.is_patched(qwen3)
    engine.revert(qwen3)
