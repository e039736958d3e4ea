"""apply / revert / plan: instance scope, idempotence, exact revert, state_dict unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_for
from snapshots import assert_same, snapshot
from transformers.models.qwen3 import modeling_qwen3

import engine
from engine.runtime import routing
from engine.verification import probe_batch


def _logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch["input_ids"]).logits


def test_plan_changes_nothing(qwen3: torch.nn.Module) -> None:
    before = snapshot(qwen3)
    the_plan = engine.plan(qwen3, "qwen3", device="cuda")
    assert_same(before, snapshot(qwen3))
    assert the_plan.device.value == "cuda"
    classes = {d.cls for d in the_plan.patched}
    assert classes == {"Qwen3RMSNorm", "Qwen3MLP", "function"}
    # 2 layers x (input, post-attention, q_norm, k_norm) + final norm
    assert sum(d.cls == "Qwen3RMSNorm" for d in the_plan.patched) == 9


def test_apply_is_per_instance_and_revert_is_exact(qwen3: torch.nn.Module) -> None:
    other = copy.deepcopy(qwen3)
    before = snapshot(qwen3)
    report = engine.apply(qwen3, "qwen3", device="cpu")
    assert len(report.patched) == 12
    norm = qwen3.model.layers[0].input_layernorm
    assert "forward" in norm.__dict__  # patched on the instance...
    assert "forward" not in other.model.layers[0].input_layernorm.__dict__  # ...not the other model
    assert type(norm).forward is modeling_qwen3.Qwen3RMSNorm.forward  # nor the class
    assert engine.revert(qwen3) is True
    assert_same(before, snapshot(qwen3))
    assert engine.revert(qwen3) is False
    assert routing.router_for(modeling_qwen3.__name__, "apply_rotary_pos_emb") is None


def test_function_patch_is_scoped_to_the_model(qwen3: torch.nn.Module) -> None:
    """Another qwen3 model in the process keeps calling the original rope."""
    other = copy.deepcopy(qwen3)
    calls: list[str] = []
    original = modeling_qwen3.apply_rotary_pos_emb

    def counting_kernel(q, k, cos, sin, unsqueeze_dim=1):
        calls.append("kernel")
        return original(q, k, cos, sin, unsqueeze_dim)

    from engine.kernels import registry

    registry.register(registry.KernelProvider(
        name="counting", op="rope", devices=registry.ALL_DEVICES, build=lambda patch: counting_kernel))
    try:
        ps = engine.load_patchset("qwen3").model_dump(mode="json")
        ps["patches"][2]["kernel"] = "counting"
        engine.apply(qwen3, ps, device="cpu")
        calls.clear()  # apply verified this content first (not bundled): its tiny model ran the kernel
        batch = probe_batch(qwen3)
        expected = _logits(other, batch)
        assert calls == []  # the unpatched model did not reach the kernel
        got = _logits(qwen3, batch)
        assert calls == ["kernel", "kernel"]  # once per attention layer
        assert torch.equal(got, expected)
        calls.clear()
        _logits(other, batch)
        assert calls == []
    finally:
        engine.revert(qwen3)
        registry.unregister("counting", "rope")


def test_apply_twice_patches_once(qwen3: torch.nn.Module) -> None:
    first = engine.apply(qwen3, "qwen3", device="cpu")
    forwards = {n: m.__dict__.get("forward") for n, m in qwen3.named_modules()}
    second = engine.apply(qwen3, "qwen3", device="cpu")
    assert second is first
    assert forwards == {n: m.__dict__.get("forward") for n, m in qwen3.named_modules()}
    router = routing.router_for(modeling_qwen3.__name__, "apply_rotary_pos_emb")
    assert router is not None and router.users == 1
    engine.revert(qwen3)
    assert routing.router_for(modeling_qwen3.__name__, "apply_rotary_pos_emb") is None


def test_another_patchset_on_a_patched_model_is_refused(qwen3: torch.nn.Module) -> None:
    engine.apply(qwen3, "qwen3", device="cpu")
    ps = engine.load_patchset("qwen3").model_dump(mode="json")
    ps["patches"] = ps["patches"][:1]
    with pytest.raises(engine.AlreadyPatched, match="revert"):
        engine.apply(qwen3, ps, device="cpu")
    engine.revert(qwen3)


def test_state_dict_parameters_and_save_pretrained_unchanged(qwen3: torch.nn.Module, tmp_path) -> None:
    unpatched = copy.deepcopy(qwen3)
    unpatched.save_pretrained(tmp_path / "before")
    sd_before = qwen3.state_dict()
    names_before = [n for n, _ in qwen3.named_parameters()]
    engine.apply(qwen3, "qwen3", device="cpu")
    sd_after = qwen3.state_dict()
    assert list(sd_after) == list(sd_before)
    assert all(torch.equal(sd_after[k], sd_before[k]) for k in sd_before)
    assert [n for n, _ in qwen3.named_parameters()] == names_before
    qwen3.save_pretrained(tmp_path / "after")
    files = sorted(p.name for p in (tmp_path / "after").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "before").iterdir())
    from safetensors.torch import load_file

    a = load_file(tmp_path / "after" / "model.safetensors")
    b = load_file(tmp_path / "before" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    engine.revert(qwen3)


def test_deepcopy_of_patched_model_is_patched_and_revertible(qwen3: torch.nn.Module) -> None:
    engine.apply(qwen3, "qwen3", device="cpu")
    twin = copy.deepcopy(qwen3)
    assert engine.is_patched(twin)
    # the copy's forwards are bound to the copy's modules, not the original's
    assert twin.model.norm.forward.__self__ is twin.model.norm
    router = routing.router_for(modeling_qwen3.__name__, "apply_rotary_pos_emb")
    assert router.users == 2
    engine.revert(qwen3)
    assert routing.router_for(modeling_qwen3.__name__, "apply_rotary_pos_emb") is router
    engine.revert(twin)
    assert routing.router_for(modeling_qwen3.__name__, "apply_rotary_pos_emb") is None
    assert modeling_qwen3.apply_rotary_pos_emb is router.original


def test_report_says_what_and_why(qwen3: torch.nn.Module) -> None:
    report = engine.apply(qwen3, "qwen3", device="cpu")
    text = str(report)
    assert "12 patched, 0 skipped" in text
    assert "Qwen3RMSNorm" in text and "rms_norm" in text and "torch" in text
    rows = report.to_dict()["decisions"]
    assert {r["path"] for r in rows} >= {"model.norm", "model.layers.1.mlp"}
    engine.revert(qwen3)


def test_optional_target_absent_is_reported_as_skipped() -> None:
    model = tiny_for("qwen3_moe", mlp_only_layers=[])  # every layer sparse: no Qwen3MoeMLP
    report = engine.apply(model, "qwen3_moe", device="cpu")
    assert ("-", "no module of this class (optional)") in report.skipped
    engine.revert(model)


def test_a_dropped_patched_model_releases_its_function_router() -> None:
    """A patched model garbage-collected without revert must not leave rope routed for others."""
    import gc

    model = tiny_for("qwen3")
    engine.apply(model, "qwen3", device="cpu")
    twin = copy.deepcopy(model)
    router = routing.router_for(modeling_qwen3.__name__, "apply_rotary_pos_emb")
    assert router is not None and router.users == 2
    del model
    gc.collect()
    assert router.users == 1 and modeling_qwen3.apply_rotary_pos_emb is router.function
    del twin
    gc.collect()
    assert routing.router_for(modeling_qwen3.__name__, "apply_rotary_pos_emb") is None
    assert modeling_qwen3.apply_rotary_pos_emb is router.original
