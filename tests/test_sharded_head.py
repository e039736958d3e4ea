"""``call_as_forward``: a function run as a module's forward goes through the module's hooks, and the
module's own forward is back afterwards (also after an error, also where an instance forward was set).

The sharded runs themselves (ZeRO-3, FSDP2) are in tests/test_deepspeed.py and tests/test_training_fsdp.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.ops.sharded_head import call_as_forward, is_sharded_head


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
