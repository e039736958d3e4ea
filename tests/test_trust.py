"""No silent no-ops, drift pins, and apply all-or-nothing under injected faults.

Faults are injected at each stage of apply: a provider's build (third patch), the op's bind
(third module: bind runs in the preparation phase, before any mutation, which the test
proves by looking at the model at each bind), the mutation of the third module, and the
routing of the second caller of a function. Every time the model must be bit-for-bit as
before: instance forwards, parameters, buffers, function namespaces and outputs.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch
from snapshots import assert_same, snapshot
from transformers.models.qwen3 import modeling_qwen3

import engine
from engine.kernels import registry
from engine.ops.rms_norm import RmsNormOp
from engine.patching import patcher
from engine.runtime import routing
from engine.tiny import build_tiny_model
from engine.verification import probe_batch

QWEN3_5 = {"layer_types": ["linear_attention", "full_attention"], "head_dim": 16, "linear_key_head_dim": 16,
           "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4}


def test_target_not_found_suggests_the_class_with_words_reordered() -> None:
    model = build_tiny_model("qwen3_5_text", QWEN3_5)
    ps = {"name": "x", "model_types": ["qwen3_5_text"],
          "patches": [{"target": "Qwen3_5GatedRMSNorm", "op": "rms_norm", "scale": "weight"}]}
    before = snapshot(model)
    with pytest.raises(engine.TargetNotFound) as info:
        engine.apply(model, ps, device="cpu")
    assert str(info.value) == (
        "patches[0] (rms_norm) targets class 'Qwen3_5GatedRMSNorm', which matches no module of Qwen3_5ForCausalLM; "
        "did you mean 'Qwen3_5RMSNormGated' or 'Qwen3_5RMSNorm'? "
        "(set `optional: true` if the class is legitimately absent in some configs)"
    )
    assert_same(before, snapshot(model))
    ps["patches"][0]["optional"] = True
    report = engine.apply(model, ps, device="cpu")
    assert report.skipped == [("-", "no module of this class (optional)")]
    engine.revert(model)


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "mine.yaml"
    path.write_text(textwrap.dedent(text))
    return path


PINNED = """\
name: mine
model_types: [qwen3]
patches:
  - target: Qwen3RMSNorm
    op: rms_norm
    scale: weight
    signature: "(self, hidden_states: torch.Tensor) -> torch.Tensor"
  - op: rope
    signature: "(q, k, cos, sin, unsqueeze_dim=1)"
"""


def test_signature_pin_that_matches_plans(qwen3: torch.nn.Module, tmp_path: Path) -> None:
    the_plan = engine.plan(qwen3, str(_write(tmp_path, PINNED)), device="cpu")
    assert len(the_plan.patched) == 10


@pytest.mark.parametrize(
    ("old", "new", "line", "what", "changes"),
    [
        ('"(self, hidden_states: torch.Tensor) -> torch.Tensor"', '"(self, x) -> torch.Tensor"', 7,
         "Qwen3RMSNorm.forward", "parameter 'x' renamed to 'hidden_states'; annotation"),
        ('"(self, hidden_states: torch.Tensor) -> torch.Tensor"',
         '"(self, hidden_states: torch.Tensor, gate: torch.Tensor) -> torch.Tensor"', 7,
         "Qwen3RMSNorm.forward", "parameter 'gate' removed"),
        ('"(q, k, cos, sin, unsqueeze_dim=1)"', '"(q, k, cos, sin, position_ids=None, unsqueeze_dim=1)"', 9,
         "transformers.models.qwen3.modeling_qwen3.apply_rotary_pos_emb", "parameter 'position_ids' removed"),
        ('"(q, k, cos, sin, unsqueeze_dim=1)"', '"(q, k, cos, sin, unsqueeze_dim=2)"', 9,
         "transformers.models.qwen3.modeling_qwen3.apply_rotary_pos_emb", "default of 'unsqueeze_dim': 2 -> 1"),
    ],
)
def test_signature_drift_names_what_changed_and_where(
    qwen3: torch.nn.Module, tmp_path: Path, old: str, new: str, line: int, what: str, changes: str
) -> None:
    path = _write(tmp_path, PINNED.replace(old, new))
    before = snapshot(qwen3)
    with pytest.raises(engine.SignatureMismatch) as info:
        engine.apply(qwen3, str(path), device="cpu")
    text = str(info.value)
    found = old.strip('"')
    assert text.startswith(f"{path}:{line}: {what} has drifted from the pinned signature: "
                           f"expected {new.strip(chr(34))}, found {found} (")
    assert changes in text
    assert "in transformers 5." in text and "update `signature`" in text
    assert f"(patch-engine verify {path})" in text  # a command that works as printed, from any folder
    assert_same(before, snapshot(qwen3))


def test_a_signature_that_is_not_one_is_a_schema_error(tmp_path: Path) -> None:
    path = _write(tmp_path, PINNED.replace('"(q, k, cos, sin, unsqueeze_dim=1)"', '"q, k"'))
    with pytest.raises(engine.PatchsetError) as info:
        engine.load_patchset(path)
    assert str(info.value) == (
        f"{path}:9: patches[1].signature: 'q, k' is not a signature such as "
        "'(self, hidden_states: torch.Tensor) -> torch.Tensor'"
    )


def test_planner_errors_point_at_the_patch(qwen3: torch.nn.Module, tmp_path: Path) -> None:
    text = PINNED.replace("target: Qwen3RMSNorm", "target: Qwen3RmsNorm")
    with pytest.raises(engine.TargetNotFound, match=rf"^{tmp_path}/mine\.yaml:4: patches\[0\] \(rms_norm\) targets "
                       r"class 'Qwen3RmsNorm'.*did you mean 'Qwen3RMSNorm'\?"):
        engine.plan(qwen3, str(_write(tmp_path, text)), device="cpu")
    gpu = registry.register(registry.KernelProvider(name="gpuonly2", op="swiglu",
                                                    devices=frozenset({registry.Device.cuda}), build=lambda p: None))
    try:
        text = PINNED + "  - target: Qwen3MLP\n    op: swiglu\n    kernel: gpuonly2\n"
        with pytest.raises(engine.DeviceUnsupported,
                           match=rf"^{tmp_path}/mine\.yaml:12: gpuonly2 requires cuda, current accelerator is cpu"):
            engine.plan(qwen3, str(_write(tmp_path, text)), device="cpu")
    finally:
        registry.unregister(gpu.name, gpu.op)


# --------------------------------------------------------------------------------------
# All-or-nothing apply under injected faults


def _outputs(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=probe_batch(model)["input_ids"]).logits


def _router_state() -> tuple:
    """The rope router of qwen3 and its user count (other tests' models may hold one)."""
    router = routing.router_for(modeling_qwen3.__name__, "apply_rotary_pos_emb")
    return (router, router.users if router else 0, modeling_qwen3.apply_rotary_pos_emb)


def _assert_untouched(model: torch.nn.Module, before: dict, logits: torch.Tensor, routers: tuple) -> None:
    assert_same(before, snapshot(model))
    assert not engine.is_patched(model)
    assert _router_state() == routers
    assert torch.equal(_outputs(model), logits)


@pytest.fixture
def flaky_provider():
    """A provider of all three ops whose build raises on its third call (the third patch)."""
    calls: list[str] = []
    references = {op: registry.get("torch", op) for op in ("rms_norm", "swiglu", "rope")}

    def build_for(op: str):
        def build(patch):
            calls.append(op)
            if len(calls) == 3:
                raise RuntimeError(f"flaky: build failed for {op}")
            return references[op].build(patch)
        return build

    for op in references:
        registry.register(registry.KernelProvider(name="flaky", op=op, devices=registry.ALL_DEVICES,
                                                  build=build_for(op)))
    yield calls
    for op in references:
        registry.unregister("flaky", op)


def test_provider_failing_on_its_third_build_changes_nothing(qwen3, flaky_provider) -> None:
    ps = engine.load_patchset("qwen3").model_dump(mode="json")
    for patch in ps["patches"]:
        patch["kernel"] = "flaky"
    before, logits, routers = snapshot(qwen3), _outputs(qwen3), _router_state()
    with pytest.raises(RuntimeError, match="flaky: build failed for rope"):  # the patcher's own builds, unverified:
        engine.apply(qwen3, ps, device="cpu", unverified="trust")  # a self-verification would build them first
    assert flaky_provider == ["rms_norm", "swiglu", "rope"]
    _assert_untouched(qwen3, before, logits, routers)


def test_bind_failing_on_the_third_module_changes_nothing(qwen3, monkeypatch) -> None:
    """bind runs for every module before the first mutation: at each call the model is still pristine."""
    real_bind = RmsNormOp.bind
    seen_patched: list[bool] = []

    def bind(self, module, patch, impl):
        seen_patched.append(any("forward" in m.__dict__ for m in qwen3.modules()) or engine.is_patched(qwen3))
        if len(seen_patched) == 3:
            raise RuntimeError("bind failed on the third module")
        return real_bind(self, module, patch, impl)

    monkeypatch.setattr(RmsNormOp, "bind", bind)
    before, logits, routers = snapshot(qwen3), _outputs(qwen3), _router_state()
    with pytest.raises(RuntimeError, match="bind failed on the third module"):
        engine.apply(qwen3, "qwen3", device="cpu")
    assert seen_patched == [False, False, False]
    _assert_untouched(qwen3, before, logits, routers)


@pytest.mark.parametrize("stage", ["_set_forward_step", "_route_caller_step"])
def test_mutation_failing_midway_is_rolled_back(qwen3, monkeypatch, stage: str) -> None:
    """The third module forward (or second routed caller) fails after earlier ones were really changed."""
    real = getattr(patcher, stage)
    fail_at = 3 if stage == "_set_forward_step" else 2
    state = {"steps": 0, "changed_before_fault": 0}

    def faulty(*args):
        step = real(*args)

        def run(records):
            state["steps"] += 1
            if state["steps"] == fail_at:
                state["changed_before_fault"] = sum("forward" in m.__dict__ for m in qwen3.modules())
                raise RuntimeError(f"injected fault in {stage}")
            step(records)
        return run

    monkeypatch.setattr(patcher, stage, faulty)
    before, logits, routers = snapshot(qwen3), _outputs(qwen3), _router_state()
    with pytest.raises(RuntimeError, match=f"injected fault in {stage}"):
        engine.apply(qwen3, "qwen3", device="cpu")
    # the fault really came after changes: 2 norms, or 11 modules and the first routed caller
    assert state["changed_before_fault"] == (2 if stage == "_set_forward_step" else 12)
    _assert_untouched(qwen3, before, logits, routers)
