"""RMSNorm variants: declared scale and cast order, the Qwen3 incident, and init conventions.

The incident this guards against: a patch guessed ``1 + w`` from ``abs(weight.mean()) < 0.3``;
on trained Qwen3-8B 18 of 145 norms have means near 0.011, so they were scaled by ``1 + w``
and the loss went from 4.69 to 8.83. Here the declaration is checked numerically against the
module's own forward, whatever the weights' values.
"""

from __future__ import annotations

import copy
import importlib
from typing import Any

import pytest
import torch
from conftest import tiny_for
from snapshots import assert_same, snapshot

import engine
from engine.errors import VerificationFailed
from engine.kernels import registry
from engine.loader import load_patchset
from engine.ops.base import get_op
from engine.ops.rms_norm import effective_weight, rms_norm_reference
from engine.schema import CastOrder, RmsNormPatch, Scale
from engine.verification import probe_batch

MINE = ["gemma", "gemma2", "gemma3_text", "olmo2", "gpt_oss", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text",
        "kimi_linear"]
HIDDEN = 64


def _norm_patches(name: str) -> list[Any]:
    return [p for p in load_patchset(name).patches if p.op in ("rms_norm", "gated_rms_norm")]


@pytest.mark.parametrize("name", MINE)
def test_tiny_norm_weights_are_trained_like(name: str) -> None:
    """The precondition of the family tests: weights where the wrong declaration would show."""
    model = tiny_for(name)
    for patch in _norm_patches(name):
        centre = 0.0 if patch.scale is Scale.one_plus_weight else 1.0
        weights = [m.weight for m in model.modules() if type(m).__name__ == patch.target]
        assert weights, patch.target
        for w in weights:
            offset = (w.detach() - centre).abs()
            assert bool((offset > 0).all()) and float(offset.max()) < 0.25, (patch.target, centre)


# --- the rms_norm reference against each formula (standalone transformers classes) ---------------------

RMS_CASES = [
    ("llama", "LlamaRMSNorm", "weight", "llama", "variance_epsilon"),
    ("qwen3", "Qwen3RMSNorm", "weight", "llama", "variance_epsilon"),
    ("kimi_linear", "KimiLinearRMSNorm", "weight", "llama", "variance_epsilon"),
    ("olmo2", "Olmo2RMSNorm", "weight", "fp32", "variance_epsilon"),
    ("gpt_oss", "GptOssRMSNorm", "weight", "fp32", "variance_epsilon"),
    ("gemma", "GemmaRMSNorm", "one_plus_weight", "fp32", "eps"),
    ("gemma2", "Gemma2RMSNorm", "one_plus_weight", "fp32", "eps"),
    ("gemma3", "Gemma3RMSNorm", "one_plus_weight", "fp32", "eps"),
    ("qwen3_next", "Qwen3NextRMSNorm", "one_plus_weight", "fp32", "eps"),
    ("qwen3_5", "Qwen3_5RMSNorm", "one_plus_weight", "fp32", "eps"),
    ("qwen3_5_moe", "Qwen3_5MoeRMSNorm", "one_plus_weight", "fp32", "eps"),
]


@pytest.mark.parametrize(("model_dir", "cls_name", "scale", "cast", "eps_attr"), RMS_CASES,
                         ids=[c[1] for c in RMS_CASES])
def test_rms_norm_reference_is_bit_exact_and_alternatives_miss(model_dir, cls_name, scale, cast, eps_attr):
    cls = getattr(importlib.import_module(f"transformers.models.{model_dir}.modeling_{model_dir}"), cls_name)
    torch.manual_seed(0)
    module = cls(HIDDEN, eps=1e-6)
    centre = 0.0 if scale == "one_plus_weight" else 1.0
    with torch.no_grad():  # trained-like: near the centre (0.011 for 1+w), never on it
        module.weight.copy_(centre + 0.011 + 0.05 * torch.randn(HIDDEN))
    patch = RmsNormPatch(op="rms_norm", target=cls_name, scale=scale, cast=cast, eps_attr=eps_attr)
    op = get_op("rms_norm")
    op.check_target(module, patch)
    x = torch.randn(3, 5, HIDDEN, generator=torch.Generator().manual_seed(1)) * 3
    for dtype in (torch.float32, torch.bfloat16):
        m = copy.deepcopy(module).to(dtype)
        with torch.no_grad():
            expected = m(x.to(dtype))
            got = op.bind(m, patch, registry.get("torch", "rms_norm").build(patch))(m, x.to(dtype))
            assert got.dtype == expected.dtype and torch.equal(got, expected), (cls_name, dtype)
            if dtype is torch.bfloat16:
                for label, alt in op.alternatives(patch):
                    other = op.bind(m, alt, registry.get("torch", "rms_norm").build(alt))(m, x.to(dtype))
                    assert other.dtype != expected.dtype or not torch.equal(other, expected), f"{label} also fits"


def test_a_weightless_instance_of_a_weighted_class_normalizes_only_when_declared():
    """Gemma 3n's value norm (``with_scale=False``) has no weight; its class's other norms have one.

    ``weight_required: false`` binds both, each bit-exact (the missing weight taken as exactly 1);
    without it the weightless instance is refused before anything is patched.
    """
    from transformers.models.gemma3n.modeling_gemma3n import Gemma3nRMSNorm

    from engine.errors import SignatureMismatch

    torch.manual_seed(0)
    weighted, bare = Gemma3nRMSNorm(HIDDEN, eps=1e-6), Gemma3nRMSNorm(HIDDEN, eps=1e-6, with_scale=False)
    with torch.no_grad():
        weighted.weight.copy_(1.011 + 0.05 * torch.randn(HIDDEN))
    op = get_op("rms_norm")
    strict = RmsNormPatch(op="rms_norm", target="Gemma3nRMSNorm", scale="weight", cast="fp32")
    with pytest.raises(SignatureMismatch, match="weight_attr"):
        op.check_target(bare, strict)
    patch = strict.model_copy(update={"weight_required": False})
    x = torch.randn(3, 5, HIDDEN, generator=torch.Generator().manual_seed(1)) * 3
    for module in (weighted, bare):
        op.check_target(module, patch)
        for dtype in (torch.float32, torch.bfloat16):
            m = copy.deepcopy(module).to(dtype)
            with torch.no_grad():
                expected = m(x.to(dtype))
                got = op.bind(m, patch, registry.get("torch", "rms_norm").build(patch))(m, x.to(dtype))
            assert got.dtype == expected.dtype and torch.equal(got, expected), (module.with_scale, dtype)
    # the scaffold finds the declaration from the weightless instance's layout
    assert any(not c.weight_required and c.cast is CastOrder.fp32 and c.scale is Scale.weight
               for c in op.candidates(bare))
    assert all(c.weight_required for c in op.candidates(weighted))


def test_one_plus_weight_is_formed_in_fp32():
    w = torch.full((4,), 0.011, dtype=torch.bfloat16)
    assert effective_weight(w, Scale.one_plus_weight).dtype == torch.float32
    assert torch.equal(effective_weight(w, Scale.one_plus_weight), w.float() + 1.0)
    assert not torch.equal(effective_weight(w, Scale.one_plus_weight), (w + 1.0).float())  # 1.0078125 in bf16
    x = torch.randn(2, 4).to(torch.bfloat16)
    y = rms_norm_reference(x, w, 1e-6, scale=Scale.one_plus_weight, cast=CastOrder.fp32)
    assert y.dtype == torch.bfloat16


# --- the incident ----------------------------------------------------------------------------------------


def _trained_like_qwen3(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny Qwen3 whose norm weights have mean ~0.011, like 18 of 145 norms of trained Qwen3-8B."""
    model = tiny_for("qwen3")
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for m in model.modules():
            if type(m).__name__ == "Qwen3RMSNorm":
                w = 0.011 + 0.004 * torch.randn(m.weight.shape, generator=gen)
                m.weight.copy_(torch.where(w == 0, torch.full_like(w, 0.011), w))
    return model.to(dtype)


def _loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).loss


def _wrong_qwen3() -> dict[str, Any]:
    data = load_patchset("qwen3").model_dump(mode="json", exclude_defaults=True)
    data["name"] = "qwen3_wrong"
    data["patches"][0]["scale"] = "one_plus_weight"  # what the guessing patch did
    return data


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_incident_trained_like_qwen3_keeps_its_loss(dtype: torch.dtype) -> None:
    model = _trained_like_qwen3(dtype)
    norms = [m.weight for m in model.modules() if type(m).__name__ == "Qwen3RMSNorm"]
    assert all(abs(float(w.detach().float().mean()) - 0.011) < 0.003 and bool((w != 0).all()) for w in norms)
    batch = probe_batch(model, seq=24)
    reference = _loss(model, batch)
    report = engine.apply(model, "qwen3", device="cpu", verify=True)
    assert report.verification.passed
    patched = _loss(model, batch)
    if dtype is torch.float32:
        assert abs(float(patched) - float(reference)) <= 1e-5
    else:
        assert torch.equal(patched, reference)


def test_incident_wrong_one_plus_weight_is_caught_and_the_model_left_unpatched() -> None:
    model = _trained_like_qwen3()
    batch = probe_batch(model, seq=24)
    reference = _loss(model, batch)

    # what the incident looked like: the wrong declaration, applied without verification, moves the loss (since
    # issue 38 only where asked for: by default apply verifies it first and refuses, tests/test_trust_by_default.py)
    wrong = copy.deepcopy(model)
    engine.apply(wrong, _wrong_qwen3(), device="cpu", unverified="trust")
    assert abs(float(_loss(wrong, batch)) - float(reference)) > 0.05

    before = snapshot(model)
    with pytest.raises(VerificationFailed) as err:
        engine.apply(model, _wrong_qwen3(), device="cpu", verify=True)
    message = str(err.value)
    assert "model.layers.0.input_layernorm" in message and "(Qwen3RMSNorm): declaration of rms_norm failed" in message
    assert "declared scale: one_plus_weight" in message
    assert "; scale: weight fits" in message
    assert not engine.patching.patcher.is_patched(model)
    assert_same(before, snapshot(model))
    assert torch.equal(_loss(model, batch), reference)

    with pytest.raises(VerificationFailed, match="scale: weight fits"):
        engine.verify(model, _wrong_qwen3(), device="cpu")  # the standalone entry point says the same
    assert_same(before, snapshot(model))


@pytest.mark.parametrize(("name", "change", "fits"), [
    ("gemma", {"scale": "weight"}, "scale: one_plus_weight fits"),
    ("olmo2", {"cast": "llama"}, "cast: fp32 fits"),
    ("gpt_oss", {"cast": "llama"}, "cast: fp32 fits"),
    ("qwen3_next", {"cast": "llama"}, "cast: fp32 fits"),
])
def test_wrong_norm_declarations_are_named(name: str, change: dict[str, str], fits: str) -> None:
    data = load_patchset(name).model_dump(mode="json", exclude_defaults=True)
    data["patches"][0].update(change)
    model = tiny_for(name)
    with pytest.raises(VerificationFailed, match=fits):
        engine.verify(model, data, device="cpu", check_model=False)


# --- init conventions: a patch neither renames nor re-initialises ---------------------------------------


def _reinit(model: torch.nn.Module, seed: int) -> None:
    """Run the model's own init again (transformers skips modules it marked initialised)."""
    for m in model.modules():
        m.__dict__.pop("_is_hf_initialized", None)
        for p in m.parameters(recurse=False):
            p.__dict__.pop("_is_hf_initialized", None)
    torch.manual_seed(seed)
    model.init_weights()


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3_text", "qwen3_next"])
def test_model_init_sees_the_same_classes_and_gives_the_same_weights(name: str) -> None:
    reference = tiny_for(name)
    patched = copy.deepcopy(reference)
    engine.apply(patched, name, device="cpu")
    ref_modules, pat_modules = dict(reference.named_modules()), dict(patched.named_modules())
    assert ref_modules.keys() == pat_modules.keys()
    for path, m in pat_modules.items():
        assert type(m) is type(ref_modules[path]), path  # same class object, so the same __name__
    targets = {p.target for p in load_patchset(name).patches if hasattr(p, "target")}
    assert {type(m).__name__ for m in pat_modules.values()} >= targets

    for model in (reference, patched):
        _reinit(model, seed=3)
    for (k, p), (k2, q) in zip(reference.named_parameters(), patched.named_parameters(), strict=True):
        assert k == k2 and torch.equal(p, q), k
    one_plus = [p.target for p in load_patchset(name).patches if getattr(p, "scale", None) is Scale.one_plus_weight]
    zeroed = [m.weight for m in pat_modules.values() if type(m).__name__ in one_plus]
    assert zeroed and all(bool((w == 0).all()) for w in zeroed)  # the family's init still finds its norms

    batch = probe_batch(reference, seq=16)
    with engine.torch_path(reference):  # with fla installed, transformers binds its linear attention to fla
        expected = _loss(reference, batch)
    assert torch.equal(_loss(patched, batch), expected)
