"""Issue 11, scenario 10: declared attributes are read when the forward runs, not once at apply.

Setting ``module.variance_epsilon`` after apply was ignored (eps was captured when the
forward was bound). The patched forwards read ``eps_attr`` and ``weight_attr`` (and a group
size held in an attribute) on every call, so the patched model follows the change exactly
as the original forward does. Compared with the unpatched model in fp32 (1e-5).
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import tiny_for
from training_helpers import grads, max_diff

import engine

TOL = 1e-5


def _set_eps(model: torch.nn.Module, classes: dict[str, str], value: float) -> int:
    changed = 0
    for module in model.modules():
        attr = classes.get(type(module).__name__)
        if attr is not None:
            setattr(module, attr, value)
            changed += 1
    return changed


def _numbers(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with engine.torch_path(model):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), grads(model)


@pytest.mark.parametrize(
    ("family", "classes"),
    [
        ("qwen3", {"Qwen3RMSNorm": "variance_epsilon"}),
        ("qwen3_next", {"Qwen3NextRMSNorm": "eps", "Qwen3NextRMSNormGated": "variance_epsilon"}),
    ],
)
def test_eps_changed_after_apply_is_used(family: str, classes: dict[str, str]) -> None:
    reference = tiny_for(family)
    model = copy.deepcopy(reference)
    engine.apply(model, family, device="cpu", mode="training")
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(4))
    try:
        before, _ = _numbers(model, ids)
        # a large eps, so the change is far above the tolerance
        assert _set_eps(model, classes, 0.5) == _set_eps(reference, classes, 0.5) > 0
        logits, g = _numbers(model, ids)
        ref_logits, ref_g = _numbers(reference, ids)
        assert (logits - before).abs().max().item() > 100 * TOL  # the change matters...
        assert (logits - ref_logits).abs().max().item() <= TOL  # ...and the patched model follows it
        assert max_diff(g, ref_g) <= TOL
    finally:
        engine.revert(model)


def test_group_size_attribute_is_read_per_call() -> None:
    """A mamba2-style gated norm whose group size lives in an attribute (``group_size_attr``)."""
    from transformers.models.mamba2 import modeling_mamba2

    from engine.ops.base import get_op
    from engine.schema import GatedRmsNormPatch

    # MambaRMSNormGated before transformers 5.25, Mamba2RMSNormGated since
    cls = getattr(modeling_mamba2, "Mamba2RMSNormGated", None) or modeling_mamba2.MambaRMSNormGated
    norm = cls(16, group_size=8, eps=1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(0))
    patch = GatedRmsNormPatch(target=cls.__name__, op="gated_rms_norm", scale="weight", activation="silu",
                              order="gate_then_norm", cast="llama", group_size_attr="group_size", kernel="torch")
    op = get_op("gated_rms_norm")
    op.check_target(norm, patch)
    from engine.kernels import registry

    impl = registry.get("torch", "gated_rms_norm").build(patch)
    forward = op.bind(norm, patch, impl)
    gen = torch.Generator().manual_seed(1)
    x, gate = torch.randn(2, 3, 16, generator=gen), torch.randn(2, 3, 16, generator=gen)
    for size in (8, 4, 16):
        norm.group_size = size
        expected = type(norm).forward(norm, x, gate)
        assert (forward(norm, x, gate) - expected).abs().max().item() <= TOL, size
