"""The audit leaves nothing behind and says only what is true (issue 46, item 3).

* Two audits in one process: whatever a patch rebinds or registers (a proxy for transformers' sdpa module's
  ``torch``, ``F.scaled_dot_product_attention``, a global optimizer hook, a torch function mode left entered, a
  process setting) is put back between patches and at the end, in ``audit_many`` and the CLI; the user's own model
  computes bit for bit what it computed before; the second patch is judged on a clean process.
* Exact patches pass: a norm's input cloned, or flattened to 2-D and back (what fused kernels do), are bit-equal
  module by module while autograd sums the model's gradients in another order; with the changes found put back the
  whole model is bit-identical, so they account for it: never "a change the detector cannot see". A real change of
  the same shape (a scale x1.01 after flattening) still differs.
* A row whose hook the whole-model difference traces to never says ``same``.
"""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from conftest import tiny_for
from torch import nn

from engine.auditing import audit, audit_many

# --- patches that reach past the model into the process -------------------------------------------------------


class _Proxy:
    """Forwards every attribute to the object it wraps but those set on it."""

    def __init__(self, real: Any):
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def sdpa_through_a_proxy(model: nn.Module) -> None:
    """transformers' sdpa module calls ``torch.nn.functional.scaled_dot_product_attention`` through its ``torch``:
    that name swapped for a proxy whose sdpa is x1.5 (no function rebound, no registry entry)."""
    from transformers.integrations import sdpa_attention

    real = torch.nn.functional.scaled_dot_product_attention
    functional = types.SimpleNamespace(scaled_dot_product_attention=lambda *a, **k: real(*a, **k) * 1.5)
    nn_proxy = _Proxy(torch.nn)
    nn_proxy.functional = functional
    proxy = _Proxy(torch)
    proxy.nn = nn_proxy
    sdpa_attention.torch = proxy


def sdpa_scaled(model: nn.Module) -> None:
    real = torch.nn.functional.scaled_dot_product_attention
    torch.nn.functional.scaled_dot_product_attention = lambda *a, **k: real(*a, **k) * 1.5


def optimizer_hooks(model: nn.Module) -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(lambda opt, args, kwargs: None)
    register_optimizer_step_post_hook(lambda opt, args, kwargs: None)


class _LinearsOnePercentOff(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        return out * 1.01 if func is torch.nn.functional.linear else out


def a_mode_left_entered(model: nn.Module) -> None:
    _LinearsOnePercentOff().__enter__()


def settings_changed(model: nn.Module) -> None:
    torch.set_float32_matmul_precision("medium")
    torch.use_deterministic_algorithms(True, warn_only=True)


def _process() -> dict[str, Any]:
    """What a patch may leave behind, by identity: names, registries, settings and mode stacks."""
    import torch.optim.optimizer as optimizer
    from transformers.integrations import sdpa_attention
    from transformers.models.qwen3 import modeling_qwen3

    module_hooks = torch.nn.modules.module
    return {
        "F.sdpa": torch.nn.functional.scaled_dot_product_attention,
        "sdpa module": dict(vars(sdpa_attention)),
        "modeling_qwen3": dict(vars(modeling_qwen3)),
        "optimizer pre hooks": dict(optimizer._global_optimizer_pre_hooks),
        "optimizer post hooks": dict(optimizer._global_optimizer_post_hooks),
        "module hooks": [dict(getattr(module_hooks, n)) for n in dir(module_hooks) if n.startswith("_global_")
                         and isinstance(getattr(module_hooks, n), dict)],
        "function modes": torch._C._len_torch_function_stack(),
        "settings": (torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_float32_matmul_precision(),
                     torch.are_deterministic_algorithms_enabled()),
    }


def _same_process(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    def same(a: Any, b: Any) -> bool:
        if isinstance(a, dict):
            return a.keys() == b.keys() and all(a[k] is b[k] for k in a)
        if isinstance(a, list):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
        return a is b or a == b

    return [key for key in before if not same(before[key], after[key])]


@pytest.fixture(scope="module")
def sdpa_qwen3() -> nn.Module:
    model = tiny_for("qwen3").train()
    model.config._attn_implementation = "sdpa"  # as checkpoints load: the patches above reach it
    return model


def _logits(model: nn.Module) -> torch.Tensor:
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        return model(input_ids=ids).logits.clone()


def test_audit_many_puts_back_all_a_patch_rebinds_or_registers_between_patches_and_at_the_end(sdpa_qwen3) -> None:
    before, logits = _process(), _logits(sdpa_qwen3)
    patches = [sdpa_through_a_proxy, optimizer_hooks, sdpa_scaled, a_mode_left_entered, settings_changed,
               lambda model: None]
    proxy, hooks, scaled, mode, flags, nothing = audit_many(sdpa_qwen3, patches)
    assert _same_process(before, _process()) == []
    assert torch.equal(_logits(sdpa_qwen3), logits)  # the user's own model, bit for bit

    [row] = [r for r in proxy.rows if r.path == "transformers.integrations.sdpa_attention.torch"]
    assert proxy.verdict == "differs" and row.change == "module rebound" and row.result == "differs"
    assert row.evidence == "put back"
    # each later patch judged on a clean process: nothing of the proxy's is left to move them
    assert {r.path.split("[")[0] for r in hooks.rows} == {"torch.optim.optimizer._global_optimizer_pre_hooks",
                                                          "torch.optim.optimizer._global_optimizer_post_hooks"}
    assert hooks.model_identical and {r.result for r in hooks.rows} == {"unchecked"}
    assert all("optimizer step" in r.note for r in hooks.rows) and hooks.verdict == "unchecked"
    assert scaled.verdict == "differs"
    [row] = [r for r in mode.rows if r.path == "the torch function mode stack"]
    assert row.result == "differs" and row.evidence == "put back" and mode.verdict == "differs"
    assert flags.model_identical and {r.change for r in flags.rows} == {"process setting changed"}
    assert nothing.verdict == "unchanged", nothing.summary()


def test_two_audits_in_one_process_the_second_judged_on_a_clean_one(sdpa_qwen3) -> None:
    before, logits = _process(), _logits(sdpa_qwen3)
    first = audit(sdpa_qwen3, sdpa_through_a_proxy)
    assert _same_process(before, _process()) == [] and torch.equal(_logits(sdpa_qwen3), logits)
    second = audit(sdpa_qwen3, lambda model: None)
    assert first.verdict == "differs" and second.verdict == "unchanged", second.summary()
    assert _same_process(before, _process()) == [] and torch.equal(_logits(sdpa_qwen3), logits)


def test_the_cli_puts_back_what_each_patch_left(capsys: pytest.CaptureFixture[str]) -> None:
    from engine.commands.cli import main

    before = _process()
    code = main(["audit", "qwen3", "--with", "tests/test_audit_restores.py:sdpa_through_a_proxy",
                 "--with", "tests/test_audit_restores.py:optimizer_hooks",
                 "--with", "tests/test_audit_restores.py:a_mode_left_entered"])
    assert code == 1, capsys.readouterr().out
    assert _same_process(before, _process()) == []


# --- exact patches, and their twins that are not ------------------------------------------------------------


def _each_norm(model: nn.Module, wrap: Any) -> None:
    for m in model.modules():
        if type(m).__name__ == "Qwen3RMSNorm":
            own = type(m).forward
            m.forward = types.MethodType(lambda self, x, _own=own: wrap(self, x, _own), m)


def norm_input_cloned(model: nn.Module) -> None:
    _each_norm(model, lambda self, x, own: own(self, x.clone()))


def norm_input_flattened(model: nn.Module) -> None:
    _each_norm(model, lambda self, x, own: own(self, x.reshape(-1, x.shape[-1])).reshape(x.shape))


def norm_input_clamped(model: nn.Module) -> None:
    """A clamp no value reaches: the forward bit-equal, one more node in autograd's graph."""
    _each_norm(model, lambda self, x, own: own(self, x.clamp(-1e4, 1e4)))


def norm_flattened_and_scaled(model: nn.Module) -> None:
    _each_norm(model, lambda self, x, own: (own(self, x.reshape(-1, x.shape[-1])) * 1.01).reshape(x.shape))


@pytest.fixture(scope="module")
def qwen3() -> nn.Module:
    return tiny_for("qwen3").train()


@pytest.mark.parametrize("patch", [norm_input_cloned, norm_input_flattened, norm_input_clamped],
                         ids=["cloned", "flattened", "clamped"])
def test_an_exact_patch_that_changes_autograds_graph_passes_and_its_changes_account_for_the_gradients(
        qwen3, patch) -> None:
    report = audit(qwen3, patch)
    assert report.verdict == "passes", report.summary()
    assert {r.result for r in report.rows} == {"same"} and not report.model_identical  # gradients summed otherwise
    assert report.accounted is True and "account for it" in report.summary()
    assert "cannot see" not in report.summary()


def test_a_real_change_of_the_same_shape_still_differs(qwen3) -> None:
    report = audit(qwen3, norm_flattened_and_scaled)
    norms = [r for r in report.rows if r.cls == "Qwen3RMSNorm"]
    assert report.verdict == "differs" and norms and all(r.result == "differs" for r in norms)


# --- a row the whole model's difference traces to -----------------------------------------------------------


def gradient_scaled_after_accumulation(model: nn.Module) -> None:
    """Runs only where ``.backward()`` accumulates (a module's ``autograd.grad`` check never runs it)."""
    def hook(p: torch.Tensor) -> None:
        p.grad.mul_(1.5)

    model.model.layers[0].mlp.up_proj.weight.register_post_accumulate_grad_hook(hook)


def gradient_nudged_and_norms_clamped(model: nn.Module) -> None:
    """Within the rounding error: a hook adding 1e-7 of a gradient to itself, beside the exact clamp above."""
    norm_input_clamped(model)

    def hook(p: torch.Tensor) -> None:
        p.grad.add_(p.grad * 1e-7)

    model.model.embed_tokens.weight.register_post_accumulate_grad_hook(hook)


def test_a_hook_the_failed_gradients_trace_to_differs_never_same(qwen3) -> None:
    report = audit(qwen3, gradient_scaled_after_accumulation)
    [row] = [r for r in report.rows if r.change == "gradient hooks added"]
    assert row.result == "differs" and row.evidence == "put back", report.summary()
    assert "with it put back, the whole model's grads" in row.note and "pass:" in row.note, row.note
    assert report.verdict == "differs" and "cannot see" not in report.summary()
    assert not any(p._post_accumulate_grad_hooks for p in qwen3.parameters())  # the patch ran on a copy


def test_a_hook_that_moves_the_gradients_within_rounding_is_not_same(qwen3) -> None:
    report = audit(qwen3, gradient_nudged_and_norms_clamped)
    [row] = [r for r in report.rows if r.change == "gradient hooks added"]
    assert row.result == "passes" and row.evidence == "put back", row
    assert "with it put back its grads" in row.note and "change (within" in row.note, row.note
    assert report.verdict == "passes" and "cannot see" not in report.summary(), report.summary()
