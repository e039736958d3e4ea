"""Wrappers around the model: ``torch.compile``, peft's ``PeftModel``, DDP, and wrappers of wrappers.

Whatever handle the user passes (the wrapper or the model inside it), ``apply``, ``revert``,
``is_patched`` and ``verify`` act on the one transformers model inside: applying through the
wrapper and then again through the inner model patches once, and one revert through either
handle restores everything. Before this, ``apply(torch.compile(model))`` stored its state on
the ``OptimizedModule``, so ``is_patched(model)`` was False, a second ``apply(model)`` patched
every forward again, and two reverts left 13 forwards patched.

torch.compile runs with the ``eager`` backend (dynamo's tracing and guards, no inductor) to
keep CI cheap; DDP runs on a real gloo process group of one process.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import tiny_for
from training_helpers import extra_kernel, grads, max_diff, qwen3_patchset

import engine
from engine.ops.rms_norm import rms_norm_reference
from engine.patching.forwards import is_ours

TOL = 1e-5
NORMS = 9  # rms_norm calls per forward of the tiny qwen3
PATCHED_FORWARDS = 13  # 9 norms, 2 MLPs, 2 attention modules routing rope


@pytest.fixture(scope="module")
def process_group(tmp_path_factory) -> Iterator[None]:
    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _peft(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1234)
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "up_proj"],
                                            init_lora_weights=False, task_type="CAUSAL_LM"))


def _compile(model: torch.nn.Module) -> torch.nn.Module:
    return torch.compile(model, backend="eager")


def _ddp(model: torch.nn.Module) -> torch.nn.Module:
    return torch.nn.parallel.DistributedDataParallel(model)


WRAPPERS: dict[str, Callable[[torch.nn.Module], torch.nn.Module]] = {
    "compile": _compile,
    "peft": _peft,
    "ddp": _ddp,
    "compile(ddp)": lambda m: _compile(_ddp(m)),
    "compile(peft)": lambda m: _compile(_peft(m)),
}


def _ours(model: torch.nn.Module) -> int:
    """How many forwards of ours are installed (in any slot) over all modules."""
    return sum(is_ours(v) for m in model.modules() for k, v in vars(m).items() if k in ("forward", "_old_forward"))


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), grads(model)


#: each wrapper once, reverted through the wrapper or the inner model (both handles are covered for compile)
CASES = [("compile", "wrapper"), ("compile", "inner"), ("peft", "inner"), ("ddp", "wrapper"),
         ("compile(ddp)", "inner"), ("compile(peft)", "wrapper")]


@pytest.mark.parametrize(("kind", "revert_through"), CASES)
def test_every_entry_point_sees_through_the_wrapper(kind: str, revert_through: str, request) -> None:
    if "ddp" in kind:
        request.getfixturevalue("process_group")
    calls: list[int] = []

    def counting(*args, **kwargs):
        calls.append(1)
        return rms_norm_reference(*args, **kwargs)

    base = tiny_for("qwen3")
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0))
    reference = WRAPPERS[kind](copy.deepcopy(base))
    expected = _loss_and_grads(reference, ids)

    inner = copy.deepcopy(base)
    wrapper = WRAPPERS[kind](inner)
    ps = qwen3_patchset(rms_norm="counting")
    with extra_kernel("counting", "rms_norm", counting):
        report = engine.apply(wrapper, ps, device="cpu", mode="training")
        assert engine.is_patched(wrapper) and engine.is_patched(inner)
        assert engine.apply(inner, ps, device="cpu", mode="training") is report  # the same model: patched once
        assert _ours(inner) == PATCHED_FORWARDS

        got = _loss_and_grads(wrapper, ids)
        assert calls, "the patched kernels ran through the wrapper"
        assert abs(got[0] - expected[0]) <= TOL and max_diff(got[1], expected[1]) <= TOL
        assert engine.verify(wrapper).passed

        first, second = (wrapper, inner) if revert_through == "wrapper" else (inner, wrapper)
        assert engine.revert(first)
        assert not engine.revert(second)  # nothing left to revert through the other handle
    assert not engine.is_patched(wrapper) and not engine.is_patched(inner)
    assert _ours(inner) == 0 and not any("forward" in vars(m) for m in inner.modules())
    calls.clear()
    got = _loss_and_grads(wrapper, ids)
    assert not calls and abs(got[0] - expected[0]) <= TOL and max_diff(got[1], expected[1]) <= TOL


def test_a_forward_patched_by_another_library_is_refused_and_the_model_left_as_it_was() -> None:
    """Another kernel library's monkey-patch (Liger-style ``partial(fn, module)``) cannot be patched beneath."""
    import functools

    def other_library_norm(module: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm_reference(hidden_states, module.weight, module.variance_epsilon)

    model = tiny_for("qwen3")
    norm = model.model.layers[1].post_attention_layernorm
    theirs = functools.partial(other_library_norm, norm)
    norm.forward = theirs
    with pytest.raises(engine.ForwardWrapped, match=r"model\.layers\.1\.post_attention_layernorm \(Qwen3RMSNorm\)"):
        engine.apply(model, qwen3_patchset(), device="cpu", mode="training")
    assert not engine.is_patched(model) and _ours(model) == 0 and norm.forward is theirs
