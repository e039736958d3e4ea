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
    [(label, alt)] = list(get_op("layer_norm").alternatives(declared))
    assert label == "scale: one_plus_weight" and torch.equal(_run(module, alt, x), module(x))


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
