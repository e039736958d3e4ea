"""layer_norm against nn.LayerNorm (with and without bias) and Nemotron's LayerNorm1P, bit for bit."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from engine.errors import SignatureMismatch
from engine.kernels import registry
from engine.ops.base import get_op
from engine.schema import LayerNormPatch, Scale
from engine.tiny import perturb_

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


def _nemotron_norm() -> nn.Module:
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P

    return NemotronLayerNorm1P(32, eps=1e-5)


CASES = [
    ("LayerNorm", lambda: nn.LayerNorm(32, eps=1e-6), Scale.weight),
    ("LayerNorm-no-bias", lambda: nn.LayerNorm(32, eps=1e-6, bias=False), Scale.weight),
    ("NemotronLayerNorm1P", _nemotron_norm, Scale.one_plus_weight),
]


def _run(module: nn.Module, patch: LayerNormPatch, x: torch.Tensor) -> torch.Tensor:
    op = get_op("layer_norm")
    return op.bind(module, patch, registry.get("torch", "layer_norm").build(patch))(module, x)


@pytest.mark.parametrize(("name", "make", "scale"), CASES, ids=[c[0] for c in CASES])
@DTYPES
def test_bit_exact_with_the_module_forward_and_grads(name, make, scale, dtype) -> None:
    module = perturb_(make(), seed=1).to(dtype)
    patch = LayerNormPatch(target=type(module).__name__, op="layer_norm", scale=scale)
    get_op("layer_norm").check_target(module, patch)
    x = (torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(0)) * 3 + 1).to(dtype).requires_grad_()
    want = type(module).forward(module, x)
    grads_want = torch.autograd.grad(want.float().pow(2).sum(), [x, *module.parameters()])
    got = _run(module, patch, x)
    grads_got = torch.autograd.grad(got.float().pow(2).sum(), [x, *module.parameters()])
    assert got.dtype == want.dtype and torch.equal(got, want)
    for a, b in zip(grads_got, grads_want, strict=True):
        assert torch.equal(a, b)


def test_wrong_scale_is_off_and_the_alternative_fits() -> None:
    module = perturb_(_nemotron_norm(), seed=1)
    declared = LayerNormPatch(target="NemotronLayerNorm1P", op="layer_norm")  # scale: weight, wrong here
    x = torch.randn(4, 32)
    assert not torch.allclose(_run(module, declared, x), module(x), atol=1e-2)
    alternatives = dict(get_op("layer_norm").alternatives(declared))
    assert list(alternatives) == ["scale: one_plus_weight", "form: centered"]
    assert torch.equal(_run(module, alternatives["scale: one_plus_weight"], x), module(x))


def test_multi_dimensional_normalized_shape_is_refused() -> None:
    with pytest.raises(SignatureMismatch, match=r"normalizes over \(4, 8\)"):
        get_op("layer_norm").check_target(nn.LayerNorm((4, 8)), LayerNormPatch(target="LayerNorm", op="layer_norm"))


def test_a_gated_or_rms_forward_is_refused() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    with pytest.raises(SignatureMismatch, match="no numeric attribute 'eps'"):
        get_op("layer_norm").check_target(LlamaRMSNorm(32), LayerNormPatch(target="LlamaRMSNorm", op="layer_norm"))


def test_scaffold_candidates_include_the_declaration() -> None:
    module = perturb_(_nemotron_norm(), seed=1)
    x = torch.randn(4, 32)
    exact = [p for p in get_op("layer_norm").candidates(module) if torch.equal(_run(module, p, x), module(x))]
    assert [(p.scale, p.eps_attr, p.weight_attr) for p in exact] == [(Scale.one_plus_weight, "eps", "weight")]



# ------------------------------------------------- OLMo 1 (no parameters), Cohere (centered, per head)


def _olmo_norm() -> nn.Module:
    from transformers.models.olmo.modeling_olmo import OlmoLayerNorm

    return OlmoLayerNorm(32)


def _cohere_norm(per_head: bool = False) -> nn.Module:
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    return CohereLayerNorm((4, 32) if per_head else 32, eps=1e-5)


VARIANTS = [
    ("OlmoLayerNorm", _olmo_norm, {"weight_attr": None, "eps": 1e-5, "precision": "fp32"}),
    ("CohereLayerNorm", _cohere_norm, {"eps_attr": "variance_epsilon", "form": "centered"}),
    ("CohereLayerNorm-per-head", lambda: _cohere_norm(per_head=True),
     {"eps_attr": "variance_epsilon", "form": "centered"}),
]


def _input(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    shape = (2, 7, 4, 32) if getattr(module, "weight", torch.empty(1)).dim() == 2 else (2, 7, 32)
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(0)) * 3 + 1).to(dtype).requires_grad_()


@pytest.mark.parametrize(("name", "make", "declared"), VARIANTS, ids=[v[0] for v in VARIANTS])
@DTYPES
def test_variants_are_bit_exact_with_their_forward_and_grads(name, make, declared, dtype) -> None:
    module = perturb_(make(), seed=1).to(dtype)
    patch = LayerNormPatch(target=type(module).__name__, op="layer_norm", **declared)
    get_op("layer_norm").check_target(module, patch)
    x = _input(module, dtype)
    params = list(module.parameters())
    want = type(module).forward(module, x)
    grads_want = torch.autograd.grad(want.float().pow(2).sum(), [x, *params])
    got = _run(module, patch, x)
    grads_got = torch.autograd.grad(got.float().pow(2).sum(), [x, *params])
    assert got.dtype == want.dtype and torch.equal(got, want)
    for a, b in zip(grads_got, grads_want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("name", "make", "declared"), VARIANTS, ids=[v[0] for v in VARIANTS])
def test_variant_candidates_hold_exactly_the_declaration(name, make, declared) -> None:
    """What the scaffold relies on: the candidates hold the declaration, and it alone is exact (fp32 and bf16)."""
    module = perturb_(make(), seed=1)
    exact = []
    for patch in get_op("layer_norm").candidates(module):
        try:
            get_op("layer_norm").check_target(module, patch)
        except SignatureMismatch:
            continue
        ok = True
        for dtype in (torch.float32, torch.bfloat16):
            m = copy.deepcopy(module).to(dtype)
            x = _input(m, dtype).detach()
            ok = ok and torch.equal(_run(m, patch, x), m(x))
        if ok:
            exact.append(patch)
    assert len(exact) == 1, exact
    assert {k: getattr(exact[0], k) for k in declared} == LayerNormPatch(
        target="X", op="layer_norm", **declared).model_dump(include=set(declared))


def test_centered_and_functional_forms_differ_so_measuring_tells_them_apart() -> None:
    module = perturb_(_cohere_norm(), seed=1)
    x = _input(module, torch.float32).detach()
    functional = LayerNormPatch(target="CohereLayerNorm", op="layer_norm", eps_attr="variance_epsilon")
    assert not torch.equal(_run(module, functional, x), module(x))
    assert (_run(module, functional, x) - module(x)).abs().max() < 1e-5  # the same function, other rounding


def test_a_literal_eps_is_named_when_no_attribute_holds_one() -> None:
    with pytest.raises(SignatureMismatch, match="writes eps as a literal: declare eps: 1e-05"):
        get_op("layer_norm").check_target(_olmo_norm(), LayerNormPatch(target="OlmoLayerNorm", op="layer_norm",
                                                                       weight_attr=None))


def test_weight_attr_null_is_refused_on_a_norm_with_a_weight() -> None:
    patch = LayerNormPatch(target="LayerNorm", op="layer_norm", weight_attr=None)
    with pytest.raises(SignatureMismatch, match="has parameters weight, but weight_attr: null"):
        get_op("layer_norm").check_target(nn.LayerNorm(32), patch)


def test_a_per_head_weight_needs_the_centered_form() -> None:
    patch = LayerNormPatch(target="CohereLayerNorm", op="layer_norm", eps_attr="variance_epsilon")
    with pytest.raises(SignatureMismatch, match="per-head"):
        get_op("layer_norm").check_target(_cohere_norm(per_head=True), patch)
