"""Verification catches wrong declarations and no-ops, and says which setting would have matched.

Each case declares a norm the way a plausible mistake would, on a tiny perturbed model of the
family, and asserts the message: module path and class, declared settings, the alternative
that fits. The model is left exactly as it was (apply(verify=True) reverts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import tiny_for
from snapshots import assert_same, snapshot
from transformers.models.qwen3 import modeling_qwen3

import engine
from engine.patching.patcher import STATE_ATTR
from engine.runtime import routing
from engine.schema import Activation
from engine.tiny import build_tiny_model
from engine.verification import Check


def _rms(target: str, **settings: str) -> dict:
    return {"target": target, "op": "rms_norm", **settings}


def _patchset(model_type: str, *patches: dict) -> dict:
    return {"name": "wrong", "model_types": [model_type], "patches": list(patches)}


def _fails(model: torch.nn.Module, ps: dict) -> engine.VerificationFailed:
    before = snapshot(model)
    with pytest.raises(engine.VerificationFailed) as info:
        engine.apply(model, ps, device="cpu", verify=True)
    assert_same(before, snapshot(model))
    assert not engine.is_patched(model)
    return info.value


def _declaration(report: engine.VerifyReport, path: str) -> dict[str, Check]:
    return {c.dtype: c for c in report.checks if c.path == path and c.what == "declaration"}


def test_one_plus_weight_declared_on_a_weight_norm(qwen3: torch.nn.Module) -> None:
    err = _fails(qwen3, _patchset("qwen3", _rms("Qwen3RMSNorm", scale="one_plus_weight")))
    text = str(err)
    assert text.startswith("patched model does not compute what the original computed:\n")
    assert (
        "  model.layers.0.self_attn.q_norm, model.layers.0.self_attn.k_norm, model.layers.0.input_layernorm, "
        "model.layers.0.post_attention_layernorm and 5 more (Qwen3RMSNorm): declaration of rms_norm failed "
        "(max abs err fp32 " in text
    )
    # the alternative's label lists the settings that differ (the op decides whether unchanged ones show)
    assert re.search(r"declared scale: one_plus_weight, cast: llama does not reproduce Qwen3RMSNorm\.forward; "
                     r"scale: weight(, cast: llama)? fits", text)
    decl = _declaration(err.report, "model.norm")
    assert not decl["fp32"].passed and decl["fp32"].max_abs > 0.1  # 1 + w vs w, w ~ 1: off by ~x_hat


def test_weight_declared_on_a_gemma_norm() -> None:
    model = build_tiny_model("gemma", {"head_dim": 16})
    err = _fails(model, _patchset("gemma", _rms("GemmaRMSNorm", scale="weight", eps_attr="eps")))
    assert "(GemmaRMSNorm): declaration of rms_norm failed" in str(err)
    assert re.search(r"declared scale: weight, cast: llama does not reproduce GemmaRMSNorm\.forward; "
                     r"scale: one_plus_weight, cast: fp32 fits", str(err))
    # the right declaration passes, bit-exactly
    right = engine.verify(model, _patchset("gemma", _rms("GemmaRMSNorm", scale="one_plus_weight", cast="fp32",
                                                         eps_attr="eps")), device="cpu")
    assert right.passed and all(c.max_abs == 0 for c in right.checks if c.what == "declaration")


def test_llama_cast_order_declared_on_an_olmo2_norm_shows_in_bf16() -> None:
    model = build_tiny_model("olmo2", {})
    err = _fails(model, _patchset("olmo2", _rms("Olmo2RMSNorm", scale="weight", cast="llama")))
    assert "(Olmo2RMSNorm): declaration of rms_norm failed" in str(err)
    assert re.search(r"does not reproduce Olmo2RMSNorm\.forward; (scale: weight, )?cast: fp32 fits", str(err))
    decl = _declaration(err.report, "model.norm")
    assert decl["fp32"].max_abs == 0  # in fp32 the two cast orders coincide...
    assert decl["bf16"].max_abs > 0  # ...bf16 rounding shows which one the module uses
    assert "max abs err fp32 0, bf16 " in str(err)


def test_interleaved_rope_declared_on_a_half_layout_function(qwen3: torch.nn.Module) -> None:
    """A function patch is judged against its alternatives too: the error says which layout fits."""
    ps = _patchset("qwen3", {"op": "rope", "function": "apply_rotary_pos_emb", "layout": "interleaved"})
    err = _fails(qwen3, ps)
    assert re.search(r"qwen3\.modeling_qwen3\.apply_rotary_pos_emb \(function\): kernel failed \(max abs err fp32 "
                     r"\S+, bf16 \S+\): declared layout: interleaved(, [^;]*)? does not compute what "
                     r"apply_rotary_pos_emb computes; layout: half fits", str(err)), str(err)


def test_silu_declared_on_a_sigmoid_gated_norm() -> None:
    """KimiLinearRMSNormGated gates with sigmoid. The op's plan-time check may already refuse a
    silu declaration (the module names its activation in an attribute); verification must
    catch it on the numbers alone too, so the second half checks the verifier directly on the
    module's real captured inputs."""
    pytest.importorskip(
        "engine.ops.gated_rms_norm", reason="the gated_rms_norm op (issue 3) is not in this branch yet"
    )
    from engine.verification.modules import verify_module
    from engine.verification.probes import capture_inputs, probe_batch

    config = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "num_key_value_heads": 4,
              "layer_types": ["linear_attention", "full_attention"], "num_experts": 4, "num_experts_per_token": 2,
              "moe_intermediate_size": 32, "linear_num_heads": 2, "linear_head_dim": 16}
    model = build_tiny_model("kimi_linear", config)
    right = {"target": "KimiLinearRMSNormGated", "op": "gated_rms_norm", "scale": "weight",
             "activation": "sigmoid", "order": "norm_then_gate", "cast": "fp32"}
    wrong = {**right, "activation": "silu"}
    before = snapshot(model)
    with pytest.raises((engine.SignatureMismatch, engine.VerificationFailed), match="sigmoid"):
        engine.apply(model, _patchset("kimi_linear", wrong), device="cpu", verify=True)
    assert_same(before, snapshot(model))

    decision = engine.plan(model, _patchset("kimi_linear", right), device="cpu").patched[0]
    silu = dataclasses.replace(decision, patch=decision.patch.model_copy(update={"activation": Activation.silu}))
    with engine.torch_path(model):  # unpatched: with fla installed, KDA is bound to fla, which needs a GPU
        captured = capture_inputs(model, [silu], probe_batch(model))
    args, kwargs = captured[silu.path]
    module = dict(model.named_modules())[silu.path]
    checks = verify_module(silu, module, args, kwargs, torch.bfloat16)
    failed = [c for c in checks if not c.passed]
    assert {c.dtype for c in failed} == {"fp32", "bf16"} and all(c.max_abs > 1e-3 for c in failed)
    note = failed[0].note
    assert note.startswith("declared ") and "activation: silu" in note.split(" does not reproduce ")[0]
    assert "sigmoid" in note.split(" does not reproduce ")[1]  # the alternative that fits
    assert note.endswith("fits")
    assert_same(before, snapshot(model))


def test_a_function_never_called_is_skipped_by_the_plan_with_its_guard() -> None:
    """SmolLM3 attention calls apply_rotary_pos_emb only in layers with rope; with none, rope is a no-op.

    The planner reads the call's guard (``if self.use_rope``) on each module: where no module's
    config calls the function, the patch is skipped with that reason (loud in the plan, nothing
    installed), not installed and then found "never called" by the verification. A call the
    planner cannot judge statically is still caught when it runs (the next test).
    """
    ps = _patchset("smollm3", {"op": "rope"})
    with_rope = build_tiny_model("smollm3", {"pad_token_id": 0, "no_rope_layers": [1, 0]})
    assert engine.verify(with_rope, ps, device="cpu").passed
    no_rope = build_tiny_model("smollm3", {"pad_token_id": 0, "no_rope_layers": [0, 0]})
    (decision,) = engine.plan(no_rope, ps, device="cpu").decisions
    assert decision.action == "skip" and "never called for this config" in decision.reason
    assert "self.use_rope" in decision.reason


def test_a_function_the_patched_model_no_longer_calls_is_a_failure(monkeypatch) -> None:
    """A function's inputs are recorded in the original's run; the patched run must still call it.

    Here the patched model's attention rotates without the routed name (as a patched attention
    forward that inlines the rotation would), while the original's calls it: the rope patch then
    changes nothing for the patched model, which verification must say.
    """
    from engine.verification import models

    model = tiny_for("qwen3")
    engine.apply(model, "qwen3", device="cpu")
    routed = modeling_qwen3.apply_rotary_pos_emb
    router = routing.router_for(modeling_qwen3.__name__, "apply_rotary_pos_emb")
    in_original: list[bool] = []
    real = models._original

    @contextlib.contextmanager
    def tracked(*args: Any, **kwargs: Any) -> Iterator[torch.nn.Module]:
        in_original.append(True)
        try:
            with real(*args, **kwargs) as original:
                yield original
        finally:
            in_original.pop()

    monkeypatch.setattr(models, "_original", tracked)
    monkeypatch.setattr(modeling_qwen3, "apply_rotary_pos_emb",
                        lambda *a, **k: (routed if in_original else router.original)(*a, **k))
    report = engine.verify(model, modules="all", raise_on_failure=False)
    (check,) = [c for c in report.checks if c.path.endswith("apply_rotary_pos_emb")]
    assert not report.passed and (check.what, check.passed) == ("called", False)
    assert "never by the patched one" in check.note
    monkeypatch.undo()
    assert engine.verify(model, modules="all").passed  # called by both: checked once, from the original's inputs


def test_report_table_and_dict(qwen3: torch.nn.Module) -> None:
    router = routing.router_for(modeling_qwen3.__name__, "apply_rotary_pos_emb")
    users = router.users if router else 0
    report = engine.verify(qwen3, "qwen3", device="cpu")
    assert not engine.is_patched(qwen3)  # verify(model, patchset) works on a copy...
    after = routing.router_for(modeling_qwen3.__name__, "apply_rotary_pos_emb")
    assert (after.users if after else 0) == users  # ...and reverts it: no router left behind
    lines = str(report).splitlines()
    assert lines[0] == (
        "verification passed: 12 patched modules and functions, 27 checks, model dtype fp32, "
        "modules checked in fp32 and bf16"
    )
    assert lines[1].split() == ["module", "class", "op", "kernel", "fp32", "diff", "/", "allowed", "bf16", "diff",
                                "/", "allowed", "result", "note"]
    assert lines[3].split() == ["model.layers.0.self_attn.q_norm", "Qwen3RMSNorm", "rms_norm", "torch", "0", "0",
                                "ok"]  # bit-equal: no bound to show
    rope = next(line for line in lines if line.startswith("qwen3.modeling_qwen3.apply_rotary_pos_emb "))
    assert rope.split()[1:4] == ["function", "rope", "torch"]
    grads = next(line for line in lines if line.startswith("<model> grads"))
    assert grads.split()[2:] == ["Qwen3ForCausalLM", "-", "-", "0", "-", "ok", "25", "parameter",
                                 "gradients;", "largest", "difference:", "none"]
    result_column = lines[1].index("result")
    assert all(line[result_column:].split()[0] == "ok" for line in lines[3:18])  # aligned columns
    data = report.to_dict()
    assert data["passed"] and data["model_dtype"] == "fp32" and data["dtypes"] == ["fp32", "bf16"]
    row = next(m for m in data["modules"] if m["module"] == "model.norm")
    assert row["errors"] == {"fp32": {"max_abs": 0.0, "max_rel": 0.0}, "bf16": {"max_abs": 0.0, "max_rel": 0.0}}
    assert data["judge"] == {"noise_factor": engine.verification.NOISE_FACTOR, "floor_ulps": engine.verification.FLOOR_ULPS, "truth": "fp64"}


def test_bf16_model_is_checked_in_fp32_and_bf16() -> None:
    model = tiny_for("qwen3", dtype=torch.bfloat16)
    report = engine.verify(model, "qwen3", device="cpu")
    assert report.model_dtype == "bf16" and report.dtypes == ("fp32", "bf16")
    assert {c.dtype for c in report.checks if c.path == "<model>"} == {"bf16"}


def test_a_kernel_that_detaches_fails_the_gradient_check(qwen3: torch.nn.Module) -> None:
    """A kernel with the right forward numbers but no gradient is caught by the model check."""
    from engine.kernels import registry
    from engine.ops.rms_norm import rms_norm_reference

    def detached(x, weight, eps):
        return rms_norm_reference(x, weight.detach(), eps)

    registry.register(registry.KernelProvider(name="detached", op="rms_norm", devices=registry.ALL_DEVICES,
                                              build=lambda patch: detached))
    try:
        ps = engine.load_patchset("qwen3").model_dump(mode="json")
        ps["patches"][0]["kernel"] = "detached"
        err = _fails(qwen3, ps)
        kernel = [c for c in err.report.checks if c.what == "kernel" and c.cls == "Qwen3RMSNorm"]
        assert kernel and all(c.passed and c.max_abs == 0 for c in kernel)  # forward numbers are right
        assert "<model> (Qwen3ForCausalLM): grads failed" in str(err)
        assert "9 of 25 parameter gradients differ; worst: model." in str(err)
        assert "(no gradient in the patched model)" in str(err)
    finally:
        registry.unregister("detached", "rms_norm")


def test_a_vision_only_model_is_probed_with_images_from_its_config() -> None:
    """PixtralVisionModel takes pixel_values and image_sizes, no token ids: the probe builds two
    images from its config (num_channels, image_size), and each is processed on its own (the
    block-diagonal mask), so the probe exercises how the model joins several images."""
    from engine.verification import probe_batch

    model = tiny_for("pixtral")
    batch = probe_batch(model)
    assert set(batch) == {"pixel_values", "image_sizes"}
    cfg = model.config
    assert batch["pixel_values"].shape == (2, cfg.num_channels, cfg.image_size, cfg.image_size)
    assert batch["image_sizes"].tolist() == [[cfg.image_size, cfg.image_size]] * 2
    patches = (cfg.image_size // cfg.patch_size) ** 2
    with torch.no_grad():
        both = model(**batch).last_hidden_state
        first = model(pixel_values=batch["pixel_values"][:1], image_sizes=batch["image_sizes"][:1]).last_hidden_state
    assert both.shape[1] == 2 * patches
    assert torch.allclose(both[:, :patches], first, atol=1e-5)
    assert not torch.allclose(both[:, :patches], both[:, patches:], atol=1e-3)
    assert "input_ids" in probe_batch(tiny_for("qwen3"))  # a token-id model is probed as before


def test_the_whole_model_check_records_the_module_inputs_without_a_forward_of_its_own() -> None:
    """With the model check on, the modules' inputs come from the original's run and the functions'
    from the patched run: two forwards of the model (was three), each check still there and passing;
    without it, one capturing forward under no_grad."""
    model = build_tiny_model("qwen3")
    calls: list[tuple[bool, bool]] = []
    model.register_forward_pre_hook(lambda m, a, k: calls.append((torch.is_grad_enabled(), "labels" in k)),
                                    with_kwargs=True)
    engine.apply(model, "qwen3", device="cpu")
    decisions = [d for d in model.__dict__[STATE_ATTR].report.decisions if d.action == "patch"]
    report = engine.verify(model, modules="all")
    assert calls == [(True, True), (True, True)]  # the original's run and the patched run, nothing else
    checked = {c.path for c in report.checks if c.what == "declaration"} | {
        c.path for c in report.checks if c.cls == "function"}
    assert checked == {d.path for d in decisions}  # every module and function was checked
    assert report.passed and not [c for c in report.checks if c.what == "called"]
    calls.clear()
    assert engine.verify(model, modules="all", check_model=False).passed
    assert calls == [(False, False)]


def test_the_difference_of_two_results_is_measured_without_touching_them() -> None:
    """``compare`` works in fp32 for fp32/bf16 inputs: the same numbers as an fp64 computation at
    the judge's resolution, NaN and infinity where they are, the caller's tensors unchanged."""
    from engine.verification.compare import compare, max_abs_diff

    gen = torch.Generator().manual_seed(0)
    want = torch.randn(3_000_000, generator=gen)
    got = want + torch.randn(3_000_000, generator=gen) * 1e-6
    kept = (got.clone(), want.clone())
    ma, mr, ok = compare(got, want)
    exact = (got.double() - want.double()).abs()
    assert ma == pytest.approx(float(exact.max()), rel=1e-6) and ok
    assert mr == pytest.approx(float((exact / want.double().abs().clamp_min(1e-12)).max()), rel=1e-5)
    assert torch.equal(got, kept[0]) and torch.equal(want, kept[1])
    assert compare(want, want.clone()) == (0.0, 0.0, True)
    assert compare(want.bfloat16(), want.bfloat16())[0] == 0.0
    off = want.clone()
    off[7] = float("nan")
    assert compare(off, want)[2] is False and compare(off, off.clone()) == (0.0, 0.0, True)
    off[7] = float("inf")
    assert compare(off, want) == (float("inf"), float("inf"), False)
    truth = want.double() + 1e-9
    assert max_abs_diff(truth, want) == pytest.approx(1e-9, rel=1e-6)


def test_progress_counts_every_module_and_the_whole_model() -> None:
    """verify(progress=...) reports modules checked out of the total, then the whole model (a bar on a terminal)."""
    model = tiny_for("qwen3")
    seen: list[tuple[int, int, str]] = []
    report = engine.verify(model, "qwen3", device="cpu",
                           progress=lambda done, total, what: seen.append((done, total, what)))
    patched = {c.path for c in report.checks if c.path != "<model>"}
    assert [s[0] for s in seen] == list(range(1, len(patched) + 2)) and {s[1] for s in seen} == {len(patched) + 1}
    assert {s[2] for s in seen[:-1]} == patched and seen[-1][2] == "the whole model"
    assert report.seconds > 0 and report.to_dict()["seconds"] == report.seconds


def test_a_wrong_declaration_that_stops_the_patched_bf16_model_is_a_failure_not_a_crash() -> None:
    """``scale: one_plus_weight`` on a bf16 Qwen3 returns fp32 from the norm, and the next Linear refuses it: the
    apply(verify=True) says the declaration failed and the model could not run as a result, and reverts."""
    import yaml

    model = build_tiny_model("qwen3", dtype=torch.bfloat16)
    root = Path(__file__).resolve().parent.parent
    data = yaml.safe_load((root / "patchsets" / "qwen3.yaml").read_text(encoding="utf-8")
                          .replace("    scale: weight\n", "    scale: one_plus_weight\n", 1))
    data["name"] = "wrong_scale"
    with pytest.raises(engine.VerificationFailed) as info:
        engine.apply(model, data, verify=True, unverified="trust")
    text = str(info.value)
    assert "scale: weight fits" in text and "could not run" in text and "as a result of the failure(s) above" in text
    assert "never by the patched one" not in text  # the stopped run is not blamed on the rope patch
    assert not engine.is_patched(model)
