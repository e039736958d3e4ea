"""The gated_rms_norm op: its reference against every gated norm of transformers, and the gate contract.

Unit tests instantiate the real transformers classes standalone (random weights away from
init, random gate) and require the reference, through the declared settings, to be
bit-exact in fp32 and bf16, and every other declaration (activation, order, scale, cast) to
miss in bf16: that is what lets verification name the one that fits.
"""

from __future__ import annotations

import copy
import importlib
from types import MethodType
from typing import Any

import pytest
import torch
from conftest import tiny_for
from snapshots import assert_same, snapshot

import engine
from engine.errors import SignatureMismatch, VerificationFailed
from engine.kernels import registry
from engine.loader import load_patchset
from engine.ops.base import get_op
from engine.schema import GatedRmsNormPatch

HIDDEN = 64


#: Classes a release renamed: the old name -> the new one (transformers 5.25: Mamba2RMSNormGated).
RENAMED = {"MambaRMSNormGated": "Mamba2RMSNormGated"}


def _cls(model_dir: str, name: str) -> type:
    module = importlib.import_module(f"transformers.models.{model_dir}.modeling_{model_dir}")
    return getattr(module, name, None) or getattr(module, RENAMED[name])


# (model dir, class, constructor kwargs, declared settings, transformers treats gate=None as "no gating")
QNEXT = {"activation": "silu", "order": "norm_then_gate", "cast": "llama"}
F32W_SIG = {"activation": "sigmoid", "order": "norm_then_gate", "cast": "fp32"}
F32W_SILU = {"activation": "silu", "order": "norm_then_gate", "cast": "fp32"}
MAMBA2 = {"activation": "silu", "order": "gate_then_norm", "cast": "llama", "group_size_attr": "group_size"}
CASES: list[tuple[str, str, dict[str, Any], dict[str, Any], bool]] = [
    ("qwen3_next", "Qwen3NextRMSNormGated", {}, QNEXT, False),
    ("qwen3_5", "Qwen3_5RMSNormGated", {}, QNEXT, False),
    ("qwen3_5_moe", "Qwen3_5MoeRMSNormGated", {}, QNEXT, False),
    ("olmo_hybrid", "OlmoHybridRMSNormGated", {}, QNEXT, False),
    ("qwen4_exp", "Qwen4ExpTextRMSNormGated", {}, QNEXT, False),
    ("kimi_linear", "KimiLinearRMSNormGated", {}, F32W_SIG, False),
    ("bailing_hybrid", "BailingHybridRMSNormGated", {}, F32W_SIG, False),
    ("glm5_next", "Glm5NextTextRMSNormGated", {}, F32W_SIG, False),
    ("lara_mini", "LaraMiniRMSNormGated", {}, F32W_SILU, False),
    ("mamba2", "MambaRMSNormGated", {"group_size": 16}, MAMBA2, True),
    ("bamba", "BambaRMSNormGated", {"group_size": 16}, MAMBA2, True),
    ("granitemoehybrid", "GraniteMoeHybridRMSNormGated", {"group_size": 32}, MAMBA2, True),
    ("nemotron_h", "NemotronHRMSNormGated", {"group_size": 64}, MAMBA2, True),
    ("zamba2", "Zamba2RMSNormGated", {"group_size": 16}, MAMBA2, True),
    ("falcon_h1", "FalconH1RMSNormGated", {"n_groups": 4},
     {**F32W_SILU, "num_groups_attr": "n_groups"}, True),
    ("falcon_h1", "FalconH1RMSNormGated", {"n_groups": 2, "norm_before_gate": False},
     {**F32W_SILU, "order": "gate_then_norm", "num_groups_attr": "n_groups"}, True),
]
IDS = [f"{c[1]}-{c[3]['order']}" if c[0] == "falcon_h1" else c[1] for c in CASES]


def _patch(target: str, **settings: Any) -> GatedRmsNormPatch:
    return GatedRmsNormPatch(op="gated_rms_norm", target=target, scale="weight", **settings)


def _bound(module: torch.nn.Module, patch: GatedRmsNormPatch) -> torch.nn.Module:
    """A deep copy of ``module`` whose forward is the op's torch reference with ``patch``'s settings."""
    op = get_op("gated_rms_norm")
    op.check_target(module, patch)
    clone = copy.deepcopy(module)
    clone.forward = MethodType(op.bind(clone, patch, registry.get("torch", op.name).build(patch)), clone)
    return clone


def _module(model_dir: str, cls_name: str, kwargs: dict[str, Any]) -> torch.nn.Module:
    torch.manual_seed(0)
    module = _cls(model_dir, cls_name)(HIDDEN, eps=1e-6, **kwargs)
    with torch.no_grad():  # around 1, never exactly 1
        module.weight.copy_(1 + torch.empty(HIDDEN).uniform_(0.05, 0.4) * torch.sign(torch.randn(HIDDEN)))
    return module


def _inputs(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 7, HIDDEN, generator=gen) * 3
    gate = torch.randn(2, 7, HIDDEN, generator=gen) * 2
    return x.to(dtype), gate.to(dtype)


@pytest.mark.parametrize(("model_dir", "cls_name", "kwargs", "settings", "gate_optional"), CASES, ids=IDS)
def test_reference_is_bit_exact_and_alternatives_miss(model_dir, cls_name, kwargs, settings, gate_optional):
    module = _module(model_dir, cls_name, kwargs)
    patch = _patch(type(module).__name__, gate_required=not gate_optional, **settings)
    op = get_op("gated_rms_norm")
    for dtype in (torch.float32, torch.bfloat16):
        original = copy.deepcopy(module).to(dtype)
        x, gate = _inputs(dtype)
        with torch.no_grad():
            expected = original(x, gate)
            got = _bound(original, patch)(x, gate)
            assert got.dtype == expected.dtype and torch.equal(got, expected), (cls_name, dtype)
            if gate_optional:  # transformers: gate=None means no gating
                assert torch.equal(_bound(original, patch)(x, None), original(x, None))
            if dtype is torch.bfloat16:
                for label, alt in op.alternatives(patch):
                    alt_out = _bound(original, alt)(x, gate) if _static_ok(original, alt) else None
                    assert alt_out is None or not torch.equal(alt_out, expected), f"{cls_name}: {label} also fits"


def _static_ok(module: torch.nn.Module, patch: GatedRmsNormPatch) -> bool:
    try:
        get_op("gated_rms_norm").check_target(module, patch)
    except SignatureMismatch:  # the instance's own activation/norm_before_gate already refuses it
        return False
    return True


# --- the gate contract: static refusal -------------------------------------------------------------


def _qwen3_next_patchset(**extra_patch: Any) -> dict[str, Any]:
    data = load_patchset("qwen3_next").model_dump(mode="json", exclude_defaults=True)
    data["patches"].append(extra_patch)
    return data


def test_gated_op_on_a_forward_without_gate_is_refused_before_patching():
    model = tiny_for("qwen3_next")
    data = load_patchset("qwen3_next").model_dump(mode="json", exclude_defaults=True)
    # the plain (ungated) norm declared as gated
    data["patches"][0] = {"target": "Qwen3NextRMSNorm", "op": "gated_rms_norm", "scale": "one_plus_weight",
                          "activation": "silu", "order": "norm_then_gate", "cast": "fp32", "eps_attr": "eps"}
    data["patches"].append(data["patches"].pop(0))  # last: the valid patches before it must not be applied
    before = snapshot(model)
    with pytest.raises(SignatureMismatch) as err:
        engine.apply(model, data, device="cpu")
    message = str(err.value)
    assert "Qwen3NextRMSNorm.forward(x)" in message and "'gate'" in message and "op: rms_norm" in message
    assert_same(before, snapshot(model))
    assert not engine.patching.patcher.is_patched(model)


def test_plain_op_on_a_gated_forward_is_refused():
    model = tiny_for("qwen3_next")
    data = load_patchset("qwen3_next").model_dump(mode="json", exclude_defaults=True)
    data["patches"][1] = {"target": "Qwen3NextRMSNormGated", "op": "rms_norm", "scale": "weight"}
    before = snapshot(model)
    with pytest.raises(SignatureMismatch, match=r"Qwen3NextRMSNormGated\.forward\(.*gate.*\).*takes gate"):
        engine.apply(model, data, device="cpu")
    assert_same(before, snapshot(model))


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"activation": "sigmoid"}, "declare activation: silu"),
        ({"group_size": 5}, "group size 5 does not divide the width 16"),
        ({"eps_attr": "eps"}, "no numeric attribute 'eps'"),
    ],
)
def test_declarations_the_instance_contradicts_are_refused(change, expected):
    model = tiny_for("qwen3_next")
    data = load_patchset("qwen3_next").model_dump(mode="json", exclude_defaults=True)
    data["patches"][1].update(change)
    with pytest.raises(SignatureMismatch, match=expected):
        engine.plan(model, data, device="cpu")


def test_declared_order_is_checked_against_falcon_norm_before_gate():
    module = _module("falcon_h1", "FalconH1RMSNormGated", {"n_groups": 2, "norm_before_gate": False})
    patch = _patch("FalconH1RMSNormGated", activation="silu", order="norm_then_gate", cast="fp32")
    with pytest.raises(SignatureMismatch, match="declare order: gate_then_norm"):
        get_op("gated_rms_norm").check_target(module, patch)


# --- the gate contract: at run time ----------------------------------------------------------------


@pytest.mark.parametrize(("name", "path", "cls_name"), [
    ("qwen3_next", "model.layers.0.linear_attn.norm", "Qwen3NextRMSNormGated"),
    ("kimi_linear", "model.layers.0.self_attn.o_norm", "KimiLinearRMSNormGated"),
])
def test_required_gate_missing_raises_value_error_naming_the_class(name, path, cls_name):
    model = tiny_for(name)
    engine.apply(model, name, device="cpu")
    norm = model.get_submodule(path)
    assert type(norm).__name__ == cls_name
    x = torch.randn(3, norm.weight.shape[0])
    for call in (lambda: norm(x, None), lambda: norm(x), lambda: norm(x, gate=None)):
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == f"{cls_name} requires a gate tensor for gated RMSNorm."
    gate = torch.randn_like(x)
    engine.revert(model)
    expected = norm(x, gate)
    engine.apply(model, name, device="cpu")
    assert torch.equal(norm(x, gate), expected)


def test_optional_gate_none_means_no_gating_in_a_real_model():
    """falcon_h1 (gate=None allowed, grouped, fp32 cast) through apply and verify, on a tiny model."""
    config = {"head_dim": 16, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_d_state": 16,
              "mamba_n_groups": 2, "mamba_chunk_size": 16, "mamba_d_conv": 4, "mamba_expand": 1,
              "mamba_rms_norm": True}
    from engine.tiny import build_tiny_model

    model = build_tiny_model("falcon_h1", config)
    patchset = {
        "name": "falcon_h1_gated", "model_types": ["falcon_h1"],
        "patches": [{"target": "FalconH1RMSNormGated", "op": "gated_rms_norm", "scale": "weight",
                     "activation": "silu", "order": "norm_then_gate", "cast": "fp32",
                     "num_groups_attr": "n_groups", "gate_required": False}],
    }
    report = engine.apply(model, patchset, device="cpu", verify=True)
    assert report.verification.passed and len(report.patched) == 2
    norm = model.model.layers[0].mamba.norm
    x = torch.randn(2, 5, 64)
    patched_out = norm(x, None)
    engine.revert(model)
    assert torch.equal(patched_out, norm(x, None))


# --- verification names the setting that fits --------------------------------------------------------


class _NormOnly(torch.nn.Module):
    """The smallest 'model' around one real transformers norm: verify captures its inputs from a forward."""

    def __init__(self, norm: torch.nn.Module, model_type: str) -> None:
        super().__init__()
        self.config = type("Config", (), {"model_type": model_type})()
        self.norm = norm

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return self.norm(x, gate)


def test_verify_names_the_activation_that_fits():
    """Falcon-H1's gate activation is hard-coded (no attribute to check statically): verify catches it."""
    model = _NormOnly(_module("falcon_h1", "FalconH1RMSNormGated", {"n_groups": 4}), "falcon_h1")
    wrong = {"name": "wrong", "model_types": ["falcon_h1"], "patches": [
        {"target": "FalconH1RMSNormGated", "op": "gated_rms_norm", "scale": "weight", "activation": "sigmoid",
         "order": "norm_then_gate", "cast": "fp32", "num_groups_attr": "n_groups"}]}
    engine.apply(model, wrong, device="cpu", unverified="trust")  # wrong on purpose: what verify says about it
    x, gate = _inputs(torch.float32)
    with pytest.raises(VerificationFailed) as err:
        engine.verify(model, batch={"x": x, "gate": gate}, check_model=False)
    assert "norm (FalconH1RMSNormGated): declaration of gated_rms_norm failed" in str(err.value)
    assert "; activation: silu fits" in str(err.value)


def test_verify_names_the_cast_that_fits_on_kimi_linear():
    model = tiny_for("kimi_linear")
    data = load_patchset("kimi_linear").model_dump(mode="json", exclude_defaults=True)
    data["patches"][1]["cast"] = "llama"
    before = snapshot(model)
    with pytest.raises(VerificationFailed) as err:
        engine.apply(model, data, device="cpu", verify=True)
    message = str(err.value)
    assert "model.layers.0.self_attn.o_norm (KimiLinearRMSNormGated): declaration of gated_rms_norm failed" in message
    assert "cast: fp32 fits" in message
    assert_same(before, snapshot(model))
    assert not engine.patching.patcher.is_patched(model)
