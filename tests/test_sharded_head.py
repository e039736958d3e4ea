"""``call_as_forward``: a function run as a module's forward goes through the module's hooks, and the
module's own forward is back afterwards (also after an error, also where an instance forward was set).
``gradients_in_backward``: the kernel's loss in the forward, its gradients formed in the backward, bit-equal.

The sharded runs themselves (ZeRO-3, FSDP2) are in tests/test_deepspeed.py and tests/test_training_fsdp.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.ops.flce_torch import chunked_linear_cross_entropy
from engine.ops.sharded_head import call_as_forward, gradients_in_backward, is_sharded_head


def test_call_as_forward_runs_the_module_hooks_and_restores_its_forward() -> None:
    head = nn.Linear(4, 3, bias=False)
    seen: list[str] = []
    head.register_forward_pre_hook(lambda m, args: seen.append("pre"))
    head.register_forward_hook(lambda m, args, out: seen.append(f"post {tuple(out.shape)}"))
    x = torch.randn(2, 4)
    out = call_as_forward(head, lambda rows: (rows @ head.weight.t()).sum(), x)
    assert seen == ["pre", "post ()"]
    assert torch.allclose(out, head(x).sum())
    assert "forward" not in head.__dict__  # the class's forward again
    assert head(x).shape == (2, 3)
    assert not is_sharded_head(head)


def test_call_as_forward_restores_an_instance_forward_after_an_error() -> None:
    head = nn.Linear(4, 3, bias=False)
    own = head.forward
    head.forward = own  # as accelerate or an engine patch installs one

    def fails(rows: torch.Tensor) -> torch.Tensor:
        raise ValueError("kernel failed")

    with pytest.raises(ValueError, match="kernel failed"):
        call_as_forward(head, fails, torch.randn(2, 4))
    assert head.__dict__["forward"] is own


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_formed_in_the_backward_are_the_kernel_s_own(dtype: torch.dtype) -> None:
    """Same loss, same gradients bit for bit, nothing formed in the forward; backward twice works (recomputed)."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(37, 16, generator=gen).to(dtype).requires_grad_()
    weight = (0.3 * torch.randn(101, 16, generator=gen)).to(dtype).requires_grad_()
    target = torch.randint(0, 101, (37,), generator=gen)
    target[[3, 9]] = -100

    def loss_of(r: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return chunked_linear_cross_entropy(r, w, target, chunk_size=8)

    direct = loss_of(rows, weight)
    want = torch.autograd.grad(direct * 0.5, (rows, weight))
    deferred = gradients_in_backward(loss_of, rows, weight)
    assert torch.equal(deferred, direct)
    assert not hasattr(deferred.grad_fn, "grads")  # the forward kept no gradient
    got = torch.autograd.grad(deferred * 0.5, (rows, weight), retain_graph=True)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    again = torch.autograd.grad(deferred * 0.5, (rows,))  # a second backward recomputes (the fused kernel's refuses)
    assert torch.equal(again[0], want[0])
    frozen = gradients_in_backward(loss_of, rows, weight.detach())
    (only,) = torch.autograd.grad(frozen, (rows,))
    assert torch.equal(only, torch.autograd.grad(loss_of(rows, weight.detach()), (rows,))[0])
