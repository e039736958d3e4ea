"""``engine.audit`` against patches written to slip past it: each changes the model in a way the change detector
used to miss, or one the whole model alone cannot locate; each must be found and the module named, and the exact
variants must pass (docs/audit.md, "What the audit sees").

Every global a patch here changes is changed on the audit's copy of the process state and put back by the audit
itself; the tests check that too, and restore by hand in ``finally`` where they change something outside a patch.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from conftest import tiny_for
from torch import nn

from engine.auditing import audit


@pytest.fixture(scope="module")
def qwen3() -> nn.Module:
    return tiny_for("qwen3").train()


def _rows(report: Any, result: str = "differs") -> list[Any]:
    return [r for r in report.rows if r.result == result]


def flip_rotate_half(model: nn.Module) -> None:
    """``rotate_half``'s sign flipped: no forward names it, ``apply_rotary_pos_emb`` reaches it by its globals."""
    from transformers.models.qwen3 import modeling_qwen3

    modeling_qwen3.rotate_half = lambda x: -torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


def test_a_function_reached_only_through_another_functions_globals_differs_and_is_put_back(qwen3) -> None:
    from transformers.models.qwen3 import modeling_qwen3

    before = modeling_qwen3.rotate_half
    report = audit(qwen3, flip_rotate_half)
    assert modeling_qwen3.rotate_half is before
    assert report.verdict == "differs"
    [row] = [r for r in report.rows if r.path.endswith("modeling_qwen3.rotate_half")]
    assert row.result == "differs" and "apply_rotary_pos_emb" in row.detail and row.max_abs > 0
    assert not all(c.passed for c in report.model_checks)


def scale_a_norm_in_place(model: nn.Module) -> None:
    with torch.no_grad():
        model.model.layers[0].input_layernorm.weight.mul_(1.01)


def test_a_weight_changed_in_place_differs_with_its_module_named(qwen3) -> None:
    before = qwen3.model.layers[0].input_layernorm.weight.detach().clone()
    report = audit(qwen3, scale_a_norm_in_place)
    assert report.verdict == "differs"
    [row] = [r for r in report.rows if r.change == "weights changed"]
    assert row.path == "model.layers.0.input_layernorm" and row.result == "differs" and "weight values changed" in row.detail
    assert torch.equal(qwen3.model.layers[0].input_layernorm.weight, before)


def fresh_head(model: nn.Module) -> None:
    head = model.lm_head
    model.lm_head = nn.Linear(head.in_features, head.out_features, bias=False)


def copied_head(model: nn.Module) -> None:
    model.lm_head = copy.deepcopy(model.lm_head)


def test_a_swapped_submodule_differs_and_an_exact_copy_passes(qwen3) -> None:
    fresh = audit(qwen3, fresh_head)
    assert fresh.verdict == "differs"
    [row] = [r for r in fresh.rows if r.path == "lm_head"]
    assert row.change == "submodule replaced" and row.result == "differs"
    same = audit(qwen3, copied_head)
    assert same.verdict == "passes", same.summary()
    assert [r.result for r in same.rows] == ["same"] and same.model_identical


def test_nothing_changed_is_unchanged_only_because_the_whole_model_is_bit_identical(qwen3) -> None:
    report = audit(qwen3, lambda model: None)
    assert report.verdict == "unchanged" and report.model_checks and report.model_identical
    assert "bit-identical" in report.summary()


def test_an_attention_entry_the_model_did_not_run_is_judged_on_the_attentions_inputs(qwen3) -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    assert qwen3.config._attn_implementation == "eager"
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def scaled(model: nn.Module) -> None:
        def attention(*args: Any, **kwargs: Any) -> Any:
            out, weights = sdpa(*args, **kwargs)
            return out * 1.5, weights

        ALL_ATTENTION_FUNCTIONS["sdpa"] = attention

    def same(model: nn.Module) -> None:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = lambda *a, **k: sdpa(*a, **k)

    try:
        wrong, right = audit(qwen3, scaled), audit(qwen3, same)
    finally:
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa
    assert wrong.verdict == "differs"
    [row] = [r for r in wrong.rows if r.change == "registry entry"]
    assert row.result == "differs" and "'sdpa'" in row.path and "ran eager" in row.note
    assert right.verdict == "passes" and [r.result for r in right.rows] == ["same"]


def test_an_attention_entry_with_no_inputs_to_judge_it_on_is_unchecked_never_passed() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    model = tiny_for("qwen3").train()
    model.config._attn_implementation = "sdpa"  # sdpa runs: eager's inputs are never recorded
    flash = ALL_ATTENTION_FUNCTIONS.get("flash_attention_2")

    def replace(m: nn.Module) -> None:
        ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = lambda *a, **k: (a[1], None)

    try:
        report = audit(model, replace)
    finally:
        if flash is not None:
            ALL_ATTENTION_FUNCTIONS["flash_attention_2"] = flash
    assert ALL_ATTENTION_FUNCTIONS.get("flash_attention_2") is flash
    [row] = [r for r in report.rows if r.change == "registry entry"]
    assert row.result == "unchecked" and "never ran" in row.note
    assert report.verdict == "unchecked"


def _no_upcast(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def no_upcast(model: nn.Module) -> None:
    import types

    for m in model.modules():
        if type(m).__name__ == "Qwen3RMSNorm":
            m.forward = types.MethodType(_no_upcast, m)


def test_a_norm_without_its_upcast_in_bf16_differs_and_is_not_explained_as_the_original() -> None:
    model = tiny_for("qwen3", dtype=torch.bfloat16).train()
    report = audit(model, no_upcast)
    norms = [r for r in report.rows if r.cls == "Qwen3RMSNorm"]
    assert norms and report.verdict == "differs"
    assert any(r.result == "differs" for r in norms)
    assert not any(r.explanation.startswith("computes what") for r in norms)
    assert any("closest" in r.explanation for r in norms)


class _ScaledBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * 2.0


def scaled_backward(model: nn.Module) -> None:
    """The MLP's forward bit-equal to the original's, its input gradient doubled."""
    import types

    mlp = model.model.layers[1].mlp
    forward = type(mlp).forward
    mlp.forward = types.MethodType(lambda self, x: forward(self, _ScaledBackward.apply(x)), mlp)


def test_a_difference_in_the_backward_only_names_the_module(qwen3) -> None:
    report = audit(qwen3, scaled_backward)
    [row] = [r for r in report.rows if r.path == "model.layers.1.mlp"]
    assert row.result == "differs" and row.max_abs and "backward differs: dinput0" in row.note
    assert report.verdict == "differs"


def test_an_activation_map_entry_is_seen_and_put_back(qwen3) -> None:
    """``ACT2FN`` (a dict subclass whose ``__getitem__`` builds a module): its entry replaced is found, restored."""
    from transformers import activations

    before = dict.get(activations.ACT2FN, "silu")

    def gelu_for_silu(model: nn.Module) -> None:
        activations.ACT2FN["silu"] = activations.ACT2FN["gelu"].__class__

    try:
        report = audit(qwen3, gelu_for_silu)
    finally:
        dict.__setitem__(activations.ACT2FN, "silu", before)
    assert dict.get(activations.ACT2FN, "silu") is before
    assert any(r.change == "registry entry" and "ACT2FN" in r.path for r in report.rows)
    assert report.model_identical  # built before the patch: this model's activations are its own modules


def liger_norms(model: nn.Module) -> None:
    """A user's own patch calling Liger's Triton op directly (no named stack): Qwen3's norms through LigerRMSNormFunction."""
    import types

    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    def forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        return LigerRMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon, 0.0, "llama", False)

    for m in model.modules():
        if type(m).__name__ == "Qwen3RMSNorm":
            m.forward = types.MethodType(forward, m)


def test_a_users_own_patch_calling_triton_is_judged_under_the_interpreter_not_unchecked(qwen3) -> None:
    pytest.importorskip("liger_kernel")
    report = audit(qwen3, liger_norms)
    norms = [r for r in report.rows if r.cls == "Qwen3RMSNorm"]
    assert norms and not any(r.result == "unchecked" for r in norms), report.summary()
    assert report.verdict == "passes", report.summary()


class _WeightGradInFp64(torch.autograd.Function):
    """``weight * hidden`` as the original computes it; the weight's gradient summed in float64 (another order of
    the same sum, closer to fp64: within the rounding error, not bit-equal), as another kernel's dW sum would be."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(weight, hidden)
        return weight * hidden

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weight, hidden = ctx.saved_tensors
        dweight = (grad.double() * hidden.double()).reshape(-1, hidden.shape[-1]).sum(0).to(weight.dtype)
        return dweight, grad * weight


def norms_with_another_dweight_sum(model: nn.Module) -> None:
    import types

    def forward(self: Any, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return _WeightGradInFp64.apply(self.weight, hidden_states.to(input_dtype))

    for m in model.modules():
        if type(m).__name__ == "Qwen3RMSNorm":
            m.forward = types.MethodType(forward, m)


def test_a_bit_equal_forward_over_a_backward_within_rounding_passes_and_explains_the_gradients(qwen3) -> None:
    """HF kernels' Liger RMSNorm in bf16: every forward bit-equal, the weight gradients summed otherwise. The
    gradients are not bit-identical, and the change found explains that: it passes, never 'a change the
    detector cannot see'; the rows say the forward is the same and the backward within its rounding error."""
    report = audit(qwen3, norms_with_another_dweight_sum)
    norms = [r for r in report.rows if r.cls == "Qwen3RMSNorm"]
    assert {r.result for r in norms} == {"same", "passes"}, report.summary()
    assert all("forward same, backward not bit-equal" in r.note for r in norms if r.result == "passes")
    assert not report.model_identical and all(c.passed for c in report.model_checks)
    assert report.verdict == "passes" and "cannot see" not in report.summary(), report.summary()


def test_a_backward_only_change_never_explains_logits_that_moved() -> None:
    """The rule itself: logits not bit-identical while every change found has a bit-equal forward differs, even where
    a backward differs within its rounding error; "a change the detector cannot see" only where putting every change
    found back leaves the whole model not bit-identical (issue 46), and where it is bit-identical then, it passes."""
    from engine.auditing.report import AuditReport, Row
    from engine.verification.results import Check

    row = Row("model.norm", "Qwen3RMSNorm", "forward replaced", "", "passes", 1e-9, 0.5, forward_same=True)

    def report(logits: float, accounted: bool | None = False) -> AuditReport:
        checks = [Check("<model>", "Qwen3ForCausalLM", "model", "logits", "fp32", logits, 0.0, True),
                  Check("<model>", "Qwen3ForCausalLM", "model", "grads", "fp32", 1e-9, 0.0, True)]
        return AuditReport("p", "Qwen3ForCausalLM", "qwen3", "fp32", rows=[row], model_checks=checks,
                           accounted=accounted)

    assert report(0.0).verdict == "passes"
    assert report(1e-7).verdict == "differs" and "cannot see" in report(1e-7).summary()
    assert report(1e-7, None).verdict == "differs" and "cannot see" not in report(1e-7, None).summary()
    assert report(1e-7, True).verdict == "passes" and "account for it" in report(1e-7, True).summary()


class _WritesIntoItsGradient(torch.autograd.Function):
    """A norm's own forward, with a backward that returns its input's gradient in the buffer of its output's (as
    Liger's RMSNorm does with ``in_place=True``): every number right, the buffer it was handed overwritten."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, forward: Any) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.weight, ctx.forward = weight, forward
        with torch.no_grad():
            return forward(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            dx, dw = torch.autograd.grad(ctx.forward(x), (x, ctx.weight), grad)
        grad.copy_(dx)
        return grad, dw, None


def norms_writing_into_their_gradient(cls_name: str) -> Any:
    import types

    def patch(model: nn.Module) -> None:
        for m in model.modules():
            if type(m).__name__ == cls_name:
                own = type(m).forward.__get__(m)
                m.forward = types.MethodType(lambda self, x, _own=own: _WritesIntoItsGradient.apply(x, self.weight, _own), m)
    return patch


def test_a_backward_writing_into_a_gradient_a_residual_shares_names_the_modules_where_it_sits() -> None:
    """twinkle's OLMo 2: Liger's in-place RMSNorm backward. Every module's forward and backward computes the
    original's numbers on a cotangent of its own; in the model, the post-norms sit inside ``residual + norm(...)``,
    whose add hands one gradient tensor to both branches, and the norm overwrites the residual's. The audit names
    those norms (the whole model passes with their gradient copied first) and leaves the harmless ones passing."""
    olmo2 = tiny_for("olmo2").train()
    report = audit(olmo2, norms_writing_into_their_gradient("Olmo2RMSNorm"))
    blamed = {r.path.rsplit(".", 1)[-1] for r in _rows(report)}
    assert blamed == {"post_attention_layernorm", "post_feedforward_layernorm"}, report.summary()
    assert all(r.evidence == "in-place gradient" and "overwrites" in r.note for r in _rows(report))
    harmless = [r for r in report.rows if r.path.endswith(("q_norm", "k_norm")) or r.path == "model.norm"]
    assert harmless and all(r.result in ("same", "passes") and "harmless where it sits" in r.note for r in harmless)
    assert report.verdict == "differs" and not report.reading_only
    assert "grads differs" in report.summary() and "Olmo2RMSNorm differs" in report.summary()


def test_a_backward_writing_into_a_gradient_nothing_shares_passes_with_a_note(qwen3) -> None:
    """The same write on qwen3's pre-norms: the norm's output gradient is a sum no one else holds. Nothing is blamed
    on the write and every whole-model check passes (the gradients, recomputed by this test's backward, are not
    bit-identical: that alone is the audit's "a change the detector cannot see", not this write)."""
    report = audit(qwen3, norms_writing_into_their_gradient("Qwen3RMSNorm"))
    assert all(c.passed for c in report.model_checks), report.summary()
    assert not [r for r in report.rows if r.evidence == "in-place gradient"], report.summary()
    noted = [r for r in report.rows if "writes into its output's gradient in place" in r.note]
    assert noted and all("harmless in this model" in r.note for r in noted)


class _CrossEntropyStoringItsGradient(torch.autograd.Function):
    """torch's cross-entropy, its gradient stored in its input (as Liger's cross_entropy does to save memory)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, kwargs: dict[str, Any]) -> torch.Tensor:
        with torch.enable_grad():
            leaf = logits.detach().requires_grad_(True)
            loss = _TORCH_CROSS_ENTROPY(leaf, target, **kwargs)
            (grad,) = torch.autograd.grad(loss, leaf)
        logits.data.copy_(grad)  # the write: behind autograd's back, as a kernel's pointer write is
        ctx.save_for_backward(grad)
        return loss.detach()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        (grad,) = ctx.saved_tensors
        return grad * grad_output, None, None


_TORCH_CROSS_ENTROPY = torch.nn.functional.cross_entropy


def cross_entropy_writing_into_the_logits(model: nn.Module) -> None:
    torch.nn.functional.cross_entropy = lambda input, target, **kw: _CrossEntropyStoringItsGradient.apply(input, target, kw)


def test_a_loss_that_stores_its_gradient_in_the_logits_is_named(qwen3) -> None:
    """Liger's granite in fp32: loss and every gradient right, the returned logits overwritten (7.6e5x), no change
    named. A library function is judged by the whole model only; copying its arguments in a rerun locates it."""
    try:
        report = audit(qwen3, cross_entropy_writing_into_the_logits)
        restored = torch.nn.functional.cross_entropy is _TORCH_CROSS_ENTROPY  # the audit put it back itself
    finally:
        torch.nn.functional.cross_entropy = _TORCH_CROSS_ENTROPY
    [row] = [r for r in report.rows if r.path == "torch.nn.functional.cross_entropy"]
    assert row.result == "differs" and row.evidence == "in-place input" and "writes into a tensor" in row.note
    checks = {c.what.split(" ")[0]: c.passed for c in report.model_checks}
    assert checks == {"logits": False, "loss": True, "grads": True}, report.summary()
    assert restored


def hook_scaling_a_norms_output(model: nn.Module) -> None:
    model.model.layers[0].post_attention_layernorm.register_forward_hook(lambda m, args, out: out * 1.01)


def hook_scaling_an_mlps_input_gradient(model: nn.Module) -> None:
    model.model.layers[1].mlp.register_full_backward_hook(lambda m, grad_in, grad_out: (grad_in[0] * 1.5,))


def hook_doubling_a_weights_gradient(model: nn.Module) -> None:
    model.model.layers[0].mlp.up_proj.weight.register_hook(lambda g: g * 2)


def hook_returning_nothing(model: nn.Module) -> None:
    model.model.layers[0].mlp.register_forward_hook(lambda m, args, out: None)


def norm_epsilon_raised(model: nn.Module) -> None:
    model.model.layers[1].input_layernorm.variance_epsilon = 1e-2


@pytest.mark.parametrize(("patch", "path", "change", "shown"), [
    (hook_scaling_a_norms_output, "model.layers.0.post_attention_layernorm", "hooks added", "forward hook"),
    (hook_scaling_an_mlps_input_gradient, "model.layers.1.mlp", "hooks added", "backward hook"),
    (hook_doubling_a_weights_gradient, "model.layers.0.mlp.up_proj", "gradient hooks added", "parameter weight"),
    (norm_epsilon_raised, "model.layers.1.input_layernorm", "attributes changed", "variance_epsilon 1e-06 -> 0.01"),
], ids=["forward hook", "backward hook", "gradient hook", "attribute"])
def test_a_hook_or_an_attribute_no_class_forward_or_weight_shows_differs_with_its_module_named(
        qwen3, patch, path, change, shown) -> None:
    """No class, forward or weight changes here: before, only the whole model differed, with nothing named."""
    report = audit(qwen3, patch)
    assert report.verdict == "differs"
    [row] = [r for r in report.rows if r.change == change]
    assert row.path == path and row.result == "differs" and shown in row.detail, row
    assert not any(r.path == path for r in _rows(report, "same"))
    assert not all(c.passed for c in report.model_checks)
    # the audit worked on a copy: the model itself has no hook and its own epsilon
    for module in qwen3.modules():
        assert not (module._forward_hooks or module._backward_hooks)
        assert getattr(module, "variance_epsilon", 1e-6) == 1e-6
    assert not any(p._backward_hooks for p in qwen3.parameters())


def test_a_hook_that_changes_nothing_passes(qwen3) -> None:
    report = audit(qwen3, hook_returning_nothing)
    assert report.verdict == "passes", report.summary()
    [row] = report.rows
    assert row.change == "hooks added" and row.result == "same" and all(c.max_abs == 0 for c in report.model_checks)


def rsqrt_off_by_one_percent(model: nn.Module) -> None:
    rsqrt = torch.rsqrt
    torch.rsqrt = lambda x: rsqrt(x) * 1.01


def tensor_pow_off_by_one_percent(model: nn.Module) -> None:
    power = torch.Tensor.pow
    torch.Tensor.pow = lambda self, exponent: power(self, exponent) * 1.01


@pytest.mark.parametrize(("patch", "path"), [(rsqrt_off_by_one_percent, "torch.rsqrt"),
                                             (tensor_pow_off_by_one_percent, "torch.Tensor.pow")],
                         ids=["torch.rsqrt", "torch.Tensor.pow"])
def test_a_torch_function_rebound_is_named_by_putting_it_back_and_is_put_back_after(qwen3, patch, path) -> None:
    """torch's own namespace and Tensor's methods: before, the audit left them rebound in the user's process and
    named nothing while the whole model differed."""
    before = torch.rsqrt, torch.Tensor.pow
    try:
        report = audit(qwen3, patch)
        assert (torch.rsqrt, torch.Tensor.pow) == before
        assert report.verdict == "differs"
        [row] = [r for r in report.rows if r.path == path]
        assert row.result == "differs" and row.evidence == "put back"
        assert "logits, loss, grads" in row.note and "pass:" in row.note, row.note
    finally:  # only where the audit did not put them back (it must)
        if torch.rsqrt is not before[0]:
            torch.rsqrt = before[0]
        if torch.Tensor.pow is not before[1]:
            del torch.Tensor.pow


def gemma2_softcap_changed(model: nn.Module) -> None:
    model.config.final_logit_softcapping = 3.0  # read by Gemma2ForCausalLM.forward on every call


def test_a_config_field_a_forward_reads_is_named_by_putting_it_back() -> None:
    model = tiny_for("gemma2").train()
    before = model.config.final_logit_softcapping
    report = audit(model, gemma2_softcap_changed)
    assert model.config.final_logit_softcapping == before  # the patch ran on a copy
    assert report.verdict == "differs"
    [row] = [r for r in report.rows if r.path == "config.final_logit_softcapping"]
    assert row.result == "differs" and row.evidence == "put back"
    assert "logits, loss, grads" in row.note and "pass:" in row.note, row.note


def freeze_a_weight(model: nn.Module) -> None:
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)


def test_a_weight_the_patch_freezes_differs_by_what_it_is(qwen3) -> None:
    """The forward is bit-equal; training silently stops updating the weight (the LoRA-adapter class of bug)."""
    report = audit(qwen3, freeze_a_weight)
    assert report.verdict == "differs" and qwen3.model.layers[0].mlp.up_proj.weight.requires_grad
    [row] = [r for r in report.rows if r.change == "requires_grad changed"]
    assert row.path == "model.layers.0.mlp.up_proj" and row.result == "differs" and "no longer updates" in row.note
    assert [c.passed for c in report.model_checks][:2] == [True, True]  # logits and loss bit-equal
