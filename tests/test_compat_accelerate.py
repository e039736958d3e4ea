"""accelerate's hooks (``cpu_offload``, ``dispatch_model``, ``from_pretrained(device_map=...)``): the patch goes beneath.

accelerate replaces each module's instance forward with a wrapper that loads the module's
weights (from a CPU state dict or from disk), calls ``module._old_forward`` and offloads them
again. The engine installs its forward *as* ``_old_forward`` when the hooks are there first,
and under the wrapper accelerate builds when they come later; revert puts back exactly what
was there, in whichever order hooks and patches come and go. Before this, ``apply`` replaced
the wrapper (``Tensor on device cpu is not on the expected device meta!``) and a revert after
hooks were added deleted accelerate's wrapper.

A counting rms_norm kernel proves the patched kernels run (9 norms per forward: 4 per layer
and the final one) and stop running after revert; numbers are compared with the unpatched,
unhooked model (fp32, <= 1e-5).
"""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import cpu_offload, dispatch_model
from accelerate.hooks import remove_hook_from_module
from conftest import tiny_for
from training_helpers import extra_kernel, grads, max_diff, qwen3_patchset

import engine
from engine.ops.rms_norm import rms_norm_reference
from engine.patching.forwards import is_ours

TOL = 1e-5
NORMS = 9  # per forward of the tiny qwen3: input/post-attention/q/k norms in 2 layers, and the final norm


@pytest.fixture
def counted():
    calls: list[int] = []

    def counting(*args, **kwargs):
        calls.append(1)
        return rms_norm_reference(*args, **kwargs)

    with extra_kernel("counting", "rms_norm", counting):
        yield calls, qwen3_patchset(rms_norm="counting")


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))


def _outputs(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = model(input_ids=_ids(), labels=_ids())
    return out.logits, out.loss


def _close(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return (got[0] - want[0]).abs().max().item() <= TOL and abs(got[1].item() - want[1].item()) <= TOL


def _hooked(module: torch.nn.Module) -> bool:
    forward = module.__dict__.get("forward")
    return "_hf_hook" in module.__dict__ and getattr(getattr(forward, "func", None), "__name__", "") == "new_forward"


def _ours_left(model: torch.nn.Module) -> list[str]:
    return [p for p, m in model.named_modules()
            if is_ours(m.__dict__.get("forward")) or is_ours(m.__dict__.get("_old_forward"))]


@pytest.mark.parametrize("order", ["hooks_then_apply", "apply_then_hooks"])
@pytest.mark.parametrize("undo", ["revert_then_unhook", "unhook_then_revert"])
def test_cpu_offload_either_order(counted, order: str, undo: str) -> None:
    calls, ps = counted
    base = tiny_for("qwen3")
    expected = _outputs(base)
    model = copy.deepcopy(base)
    if order == "hooks_then_apply":
        cpu_offload(model, execution_device=torch.device("cpu"))
        engine.apply(model, ps, device="cpu", mode="inference")
    else:
        engine.apply(model, ps, device="cpu", mode="inference")
        cpu_offload(model, execution_device=torch.device("cpu"))
    calls.clear()  # the first apply of this content (not bundled) verified it first: its tiny model ran the kernel
    norm = model.model.layers[0].input_layernorm
    assert norm.weight.device.type == "meta" and _hooked(norm)  # really offloaded, accelerate's wrapper on top
    assert _close(_outputs(model), expected)
    assert len(calls) == NORMS
    calls.clear()

    if undo == "revert_then_unhook":
        assert engine.revert(model)
        assert _hooked(norm) and norm.weight.device.type == "meta"  # accelerate's wrapper kept, still offloading
        assert _close(_outputs(model), expected) and not calls
        remove_hook_from_module(model, recurse=True)
    else:
        remove_hook_from_module(model, recurse=True)
        assert _close(_outputs(model), expected) and len(calls) == NORMS  # unhooked, still patched
        calls.clear()
        assert engine.revert(model)
    assert not _hooked(norm) and norm.weight.device.type == "cpu"
    assert _close(_outputs(model), expected) and not calls
    assert not _ours_left(model) and not engine.is_patched(model)


def test_dispatch_model_with_hooks_trains_like_unpatched(counted) -> None:
    """Hooks without offload (weights stay real): loss and every gradient as without the engine."""
    calls, ps = counted
    base = tiny_for("qwen3")
    ids = _ids()
    reference = copy.deepcopy(base)
    reference(input_ids=ids, labels=ids).loss.backward()

    model = dispatch_model(copy.deepcopy(base), device_map={"": "cpu"}, main_device="cpu", force_hooks=True)
    assert _hooked(model.model.layers[0].input_layernorm)
    engine.apply(model, ps, device="cpu", mode="training")
    assert _hooked(model.model.layers[0].input_layernorm)  # accelerate's wrapper stays on top
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert calls and max_diff(grads(model), grads(reference)) <= TOL
    engine.revert(model)
    assert _hooked(model.model.layers[0].input_layernorm) and not _ours_left(model)


def _disk_map(model: torch.nn.Module) -> dict[str, str]:
    device_map = {name: "cpu" for name, _ in model.named_children()}
    device_map.pop("model")
    device_map.update({f"model.{name}": "cpu" for name, _ in model.model.named_children()})
    device_map.pop("model.layers")
    device_map.update({"model.layers.0": "cpu", "model.layers.1": "disk"})
    return device_map


def test_dispatch_model_disk_offload(counted, tmp_path) -> None:
    calls, ps = counted
    base = tiny_for("qwen3")
    expected = _outputs(base)
    model = dispatch_model(copy.deepcopy(base), device_map=_disk_map(base), main_device="cpu",
                           offload_dir=str(tmp_path / "offload"))
    assert model.model.layers[1].input_layernorm.weight.device.type == "meta"
    engine.apply(model, ps, device="cpu", mode="inference")
    assert _close(_outputs(model), expected) and len(calls) == NORMS
    engine.revert(model)
    assert _close(_outputs(model), expected) and len(calls) == NORMS
    assert _hooked(model.model.layers[1].input_layernorm) and not _ours_left(model)


def test_from_pretrained_with_offload(counted, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    calls, ps = counted
    base = tiny_for("qwen3")
    expected = _outputs(base)
    base.save_pretrained(tmp_path / "ckpt")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", device_map=_disk_map(base), offload_folder=str(tmp_path / "offload"),
        attn_implementation="eager")
    assert model.model.layers[1].mlp.up_proj.weight.device.type == "meta"  # loaded from disk at each forward
    assert _close(_outputs(model), expected)
    engine.apply(model, ps, device="cpu", mode="inference")
    assert _close(_outputs(model), expected) and len(calls) == NORMS
    engine.revert(model)
    assert _close(_outputs(model), expected) and len(calls) == NORMS and not _ours_left(model)
