"""``engine.apply(model)`` with no patchset: the bundled file of its type, else measured, verified, applied.

Every test builds a real tiny transformers model (perturbed weights), patches it with no
configuration, and judges the patched model's logits, loss and gradients against the same
model unpatched. The measured path is tested on types without a bundled patchset (forced with
``"measure"`` where a bundled file may land later), on a family transformers does not know
(a renamed copy of Qwen3's classes registered with the Auto classes), on remote code, and
where measurement finds nothing to patch. A declaration that fails verification is dropped,
never applied.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from training_helpers import grads, max_diff

import engine
from engine.errors import TargetNotFound, ZeroConfigWarning
from engine.tiny import build_tiny_model, perturb_
from engine.zeroconfig import bundled
from engine.zeroconfig.verdict import verified_subset

TOL = 1e-5


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh verdict and measurement cache per test: each test measures and verifies for itself."""
    monkeypatch.setenv("PATCH_ENGINE_CACHE_DIR", str(tmp_path / "cache"))


def _numbers(model: nn.Module, **inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Logits, loss and gradients on a fixed batch of ids (plus ``inputs``: GIT's images)."""
    ids = torch.randint(0, model.config.get_text_config().vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # a training forward may draw (phimoe's router jitter): the same draws both ways
    out = model(input_ids=ids, labels=ids, **inputs)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), grads(model)


def _assert_same_numbers(model: nn.Module, patched: nn.Module, **inputs: torch.Tensor) -> None:
    logits, loss, g = _numbers(model, **inputs)
    p_logits, p_loss, p_g = _numbers(patched, **inputs)
    assert (p_logits - logits).abs().max().item() <= TOL
    assert abs(p_loss.item() - loss.item()) <= TOL
    assert max_diff(g, p_g) <= 1e-4


def _zero_config(model: nn.Module, patchset: str | None = None, inputs: dict[str, torch.Tensor] | None = None,
                 **kwargs):  # type: ignore[no-untyped-def]
    """Patch a copy of ``model`` with no configuration; assert it patched, verified, and computes the same.

    ``inputs``: what the model takes beside ids and labels to compute its loss (GIT's images).
    """
    patched = copy.deepcopy(model)
    report = engine.apply(patched, patchset, **kwargs)
    assert report.patched, str(report)
    assert engine.verify(patched, raise_on_failure=False).passed
    _assert_same_numbers(model, patched, **(inputs or {}))
    return report


def test_a_bundled_family_gets_its_bundled_patchset() -> None:
    model = build_tiny_model("qwen3")
    report = _zero_config(model)
    assert report.patchset == "qwen3"
    assert report.zero_config.source == "bundled" and report.zero_config.bundled == "qwen3"
    assert "the bundled patchset 'qwen3'" in str(report)


@pytest.mark.parametrize("model_type", ["olmo", "starcoder2", "phimoe", "cohere2",
                                        pytest.param("qwen3_moe", marks=pytest.mark.slow)])
def test_measured_declarations_patch_families_without_a_hand_written_map(model_type: str) -> None:
    """``"measure"`` measures even where a bundled file exists (issue 41 bundles some of these)."""
    model = build_tiny_model(model_type)
    report = _zero_config(model, "measure")
    zc = report.zero_config
    assert zc.source == "measured" and zc.patched and not zc.failed
    assert zc.verdict is not None and zc.verdict["checks"] > 0
    assert report.patchset == f"{model_type}.measured"
    # what is not patched is said, with its reason
    assert all(":" in line for line in zc.not_patched)
    if model_type == "qwen3_moe":  # the experts are measured and patched, beside the dense layer (mlp_only_layers)
        assert any(line.startswith("Qwen3MoeExperts: moe_experts") for line in zc.patched), zc.patched


def test_a_composite_model_is_measured_on_a_tiny_copy_of_its_own_sub_configs() -> None:
    """LLaVA: text and vision sub-configs shrunk by their own sizes; its language model's declarations measured."""
    from engine.tiny import build_tiny_for

    model = build_tiny_for(engine.load_patchset("llava"))
    report = _zero_config(model, "measure")
    ops = {line.split(": ")[1].split(" ")[0] for line in report.zero_config.patched}
    assert {"rms_norm", "swiglu"} <= ops, report.zero_config.patched


def test_the_second_apply_reads_the_measurement_and_the_verdict_from_the_cache() -> None:
    model = build_tiny_model("olmo")
    first = _zero_config(model, "measure")
    second = _zero_config(model, "measure")
    assert not first.zero_config.measure_cached and not first.zero_config.verdict["cached"]
    assert second.zero_config.measure_cached and second.zero_config.verdict["cached"]
    assert second.zero_config.patched == first.zero_config.patched


def test_apply_measure_leaves_the_callers_random_state_alone() -> None:
    model = build_tiny_model("olmo")
    torch.manual_seed(42)
    expected = torch.rand(3)
    torch.manual_seed(42)
    engine.apply(copy.deepcopy(model), "measure")
    assert torch.equal(torch.rand(3), expected)


# ------------------------------------------------------------------- a family transformers does not know


@pytest.fixture
def renamed_qwen3():  # type: ignore[no-untyped-def]
    """Qwen3's classes under a new ``model_type``, registered with the Auto classes, unregistered after."""
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    class RenamedQwen3Config(Qwen3Config):
        model_type = "renamed_qwen3"

    class RenamedQwen3ForCausalLM(Qwen3ForCausalLM):
        config_class = RenamedQwen3Config

    AutoConfig.register("renamed_qwen3", RenamedQwen3Config)
    AutoModelForCausalLM.register(RenamedQwen3Config, RenamedQwen3ForCausalLM)
    try:
        yield RenamedQwen3Config
    finally:  # AutoConfig.register mutates global mappings
        CONFIG_MAPPING._extra_content.pop("renamed_qwen3", None)
        MODEL_FOR_CAUSAL_LM_MAPPING._extra_content.pop(RenamedQwen3Config, None)
        bundled.bundled_types.cache_clear()


def test_a_family_transformers_does_not_know_is_patched_with_no_configuration(renamed_qwen3) -> None:  # type: ignore[no-untyped-def]
    model = _renamed_tiny(renamed_qwen3)
    assert type(model).__name__ == "RenamedQwen3ForCausalLM"
    report = _zero_config(model)
    zc = report.zero_config
    assert zc.source == "measured" and zc.model_type == "renamed_qwen3"
    ops = {line.split(": ")[1].split(" ")[0] for line in zc.patched}
    assert {"rms_norm", "swiglu", "rope"} <= ops, zc.patched


# ------------------------------------------------------------------- remote code


def test_a_remote_code_model_is_measured_on_its_own_code(tmp_path: Path) -> None:
    from remote_checkpoint import isolated_modules_cache, load_checkpoint, write_checkpoint

    with isolated_modules_cache(tmp_path):
        model = load_checkpoint(write_checkpoint(tmp_path / "toyllama_ckpt"))
        assert type(model).__module__.startswith("transformers_modules.")
        report = _zero_config(model)
        zc = report.zero_config
        assert zc.source == "measured"
        assert any(line.startswith("ToyRMSNorm: rms_norm") and "one_plus_weight" in line for line in zc.patched), zc.patched
        engine.revert(model)


# ------------------------------------------------------------------- nothing refused silently




def _bare_model() -> nn.Module:
    """A causal LM with nothing any op computes: an embedding and a linear head."""
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutput

    class BareConfig(PretrainedConfig):
        model_type = "bare_lm"

        def __init__(self, vocab_size: int = 64, hidden_size: int = 16, **kwargs):  # type: ignore[no-untyped-def]
            self.vocab_size, self.hidden_size = vocab_size, hidden_size
            super().__init__(**kwargs)

    class BareLM(PreTrainedModel):
        config_class = BareConfig

        def __init__(self, config: BareConfig):
            super().__init__(config)
            self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
            self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

        def forward(self, input_ids=None, labels=None, **kwargs):  # type: ignore[no-untyped-def]
            logits = self.head(torch.tanh(self.embed(input_ids)))
            loss = None if labels is None else nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
            return CausalLMOutput(loss=loss, logits=logits)

    torch.manual_seed(0)
    return perturb_(BareLM(BareConfig()))


def test_a_model_with_nothing_to_patch_gets_a_report_and_a_warning_not_an_error() -> None:
    model = _bare_model()
    with pytest.warns(ZeroConfigWarning, match="patched nothing"):
        report = engine.apply(model)
    assert not report.patched and not engine.is_patched(model)
    assert report.zero_config.source == "measured" and not report.zero_config.patched
    assert "0 verified and applied" in str(report)
    with pytest.raises(TargetNotFound, match="patched nothing"), warnings.catch_warnings():
        engine.apply(model, strict=True)
    assert not engine.is_patched(model)


def test_a_declaration_that_fails_verification_is_dropped_and_the_rest_verified() -> None:
    """The drop logic on real numbers: a flipped norm beside a correct MLP (as if measured)."""
    model = build_tiny_model("qwen3")
    measured = engine.load_patchset({"name": "flipped", "model_types": ["qwen3"], "patches": [
        {"target": "Qwen3RMSNorm", "op": "rms_norm", "scale": "one_plus_weight"},
        {"target": "Qwen3MLP", "op": "swiglu"},
    ]})
    verdict = verified_subset(model, measured, engine.plan(model, measured))
    assert verdict.passed == [1]
    assert set(verdict.failed) == {0} and "Qwen3RMSNorm" in verdict.failed[0]
    again = verified_subset(model, measured, engine.plan(model, measured))
    assert again.cached and again.passed == [1] and set(again.failed) == {0}


def test_zero_config_report_has_a_json_form() -> None:
    import json

    report = engine.apply(copy.deepcopy(build_tiny_model("olmo")), "measure")
    data = json.loads(json.dumps(report.to_dict()))
    assert data["zero_config"]["source"] == "measured" and data["zero_config"]["patched"]


# ------------------------------------------------------------------- launchers: no patchset named


def _renamed_tiny(config_class: type) -> nn.Module:
    from transformers import AutoModelForCausalLM

    config = config_class(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=256, head_dim=16, max_position_embeddings=128)
    torch.manual_seed(0)
    return perturb_(AutoModelForCausalLM.from_config(config, attn_implementation="eager"))


def test_trainer_callback_with_no_name_measures_and_trains_like_unpatched(tmp_path: Path, renamed_qwen3) -> None:  # type: ignore[no-untyped-def]
    """``PatchsetCallback()`` with no name on a type no bundled file covers: measured, verified, same losses."""
    from transformers import Trainer, TrainingArguments

    from engine.integrations.transformers import PatchsetCallback

    gen = torch.Generator().manual_seed(0)
    data = [{"input_ids": (ids := torch.randint(0, 256, (16,), generator=gen)), "labels": ids.clone()} for _ in range(8)]

    def losses(callbacks: list, out: str) -> tuple[list[float], nn.Module]:  # type: ignore[type-arg]
        model = _renamed_tiny(renamed_qwen3)
        args = TrainingArguments(output_dir=str(tmp_path / out), max_steps=3, per_device_train_batch_size=4,
                                 learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                                 disable_tqdm=True, seed=0, dataloader_num_workers=0)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
        trainer.train()
        return [row["loss"] for row in trainer.state.log_history if "loss" in row], model

    reference, _ = losses([], "ref")
    callback = PatchsetCallback()
    patched, model = losses([callback], "cb")
    assert engine.is_patched(model) and callback.report is not None
    assert callback.report.zero_config.source == "measured" and callback.report.zero_config.patched
    assert max(abs(a - b) for a, b in zip(reference, patched, strict=True)) <= TOL


# ------------------------------------------------------------------- the command line


def _cli(argv: list[str]) -> tuple[int, str, str]:
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from engine.commands.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_cli_plan_and_verify_take_no_patchset() -> None:
    import json

    code, out, err = _cli(["plan", "--model-type", "qwen3"])
    assert code == 0, err
    assert "the bundled patchset 'qwen3'" in out
    code, out, err = _cli(["plan", "measure", "--model-type", "qwen3", "--json"])
    assert code == 0, err
    data = json.loads(out)
    assert data["zero_config"]["source"] == "measured" and data["zero_config"]["patched"]
    assert any(d["action"] == "patch" for d in data["decisions"])
    code, out, err = _cli(["verify", "measure", "--model-type", "qwen3"])
    assert code == 0, err
    assert "verify (zero configuration)" in out and "passed" in out
    code, _, err = _cli(["verify"])
    assert code == 2 and "--model-type" in err


def test_cli_plan_of_a_remote_code_folder_with_no_patchset(tmp_path: Path) -> None:
    import json

    from remote_checkpoint import isolated_modules_cache, write_checkpoint

    with isolated_modules_cache(tmp_path):
        folder = write_checkpoint(tmp_path / "toyllama_ckpt")
        code, out, err = _cli(["plan", "--model", str(folder), "--trust-remote-code", "--json"])
    assert code == 0, err
    data = json.loads(out)
    assert data["zero_config"]["source"] == "measured"
    assert any(line.startswith("ToyRMSNorm: rms_norm") for line in data["zero_config"]["patched"])


@pytest.mark.parametrize("model_type", ["bart", "whisper"])
def test_an_encoder_decoders_cross_attention_norms_are_verified_on_a_reached_instances_inputs(model_type: str) -> None:
    """Its causal-LM class never passes encoder states, so the cross-attention LayerNorms never run.

    They are the class whose other instances ran: each is checked on a reached one's recorded
    inputs (its own weights), and says so; the patch is then applied to all of them.
    """
    model = build_tiny_model(model_type)
    perturb_(model)
    report = _zero_config(model)
    assert any(line.startswith("LayerNorm: layer_norm") for line in report.zero_config.patched), report.zero_config.patched
    patched = copy.deepcopy(model)
    engine.apply(patched)
    verdict = engine.verify(patched, modules="all", raise_on_failure=False)
    cross = [c for c in verdict.checks if "encoder_attn_layer_norm" in c.path]
    assert cross and all(c.passed for c in cross), verdict
    called = [c for c in cross if c.what == "called"]
    assert called and all("not reached by the verification forward" in c.note for c in called)
    assert {c.what for c in cross} >= {"called", "declaration"}


def test_a_captioning_model_is_measured_and_verified_on_its_images() -> None:
    """GIT's loss scores the logits after its image tokens: the probe gives it images, as it trains.

    On ids alone its loss slices an empty span (``Expected input batch_size (0) to match target
    batch_size``), and the scaffold never reached its vision tower's MLP.
    """
    from engine.verification.probes import inline_images

    model = build_tiny_model("git")
    images = inline_images(model, batch=2, seed=3)
    assert images["pixel_values"].shape[0] == 2
    report = _zero_config(model, inputs=images)
    patched = report.zero_config.patched
    assert any(line.startswith("GitVisionMLP: mlp") for line in patched), patched
    assert any(line.startswith("LayerNorm: layer_norm") for line in patched), patched


#: The families issue 41 names as having no patchset before it (Gemma 3n apart: see its own test).
NAMED_FAMILIES = ["mistral3", "granitemoehybrid", "nemotron_h", "cohere", "cohere2", "olmo", "phi", "phimoe",
                  "starcoder2", "stablelm", "gpt_neox", "falcon", "llava_next", "llava_onevision", "idefics3",
                  "smolvlm", "lfm2_moe", "lfm2_vl", "jamba", "bamba", "zamba2", "minicpm3"]


@pytest.mark.parametrize("model_type", NAMED_FAMILIES)
def test_each_named_family_is_patched_with_no_patchset_named(model_type: str) -> None:
    """``engine.apply(model)``: its bundled patchset (CI verified that content), at least one module, the same numbers."""
    model = build_tiny_model(model_type)
    perturb_(model)
    patched = copy.deepcopy(model)
    report = engine.apply(patched)
    zc = report.zero_config
    assert report.patched, str(report)
    if model_type == "mistral3":  # the default config's Pixtral runs GELU where the checkpoints (and the file) say SiLU
        assert zc.source == "measured" and "the bundled patchset 'mistral3' does not fit" in zc.bundled_misfit, str(zc)
        assert "the bundled patchset 'mistral3' does not fit this model's config" in str(zc)
    else:
        assert zc.source == "bundled" and zc.bundled == model_type or model_type == "smolvlm", str(zc)
    assert any(d.action == "patch" and d.site is None for d in report.decisions), str(report)  # a module, not only rope
    _assert_same_numbers(model, patched)


@pytest.mark.parametrize("model_type", ["hy_v4_vl", "shieldgemma2", "dbrx"])
def test_measured_types_whose_tiny_model_needed_the_right_inputs_or_sizes(model_type: str) -> None:
    """Each failed for its tiny model's inputs or sizes, not for a declaration.

    hy_v4_vl: its vision tower takes flattened patches with ``image_grid_thw`` but names no
    ``temporal_patch_size``: the verifier gave it no pixels and checked its norms, never reached,
    on a text layer's inputs of another width. shieldgemma2: Gemma 3's projector pools the tiny
    tower's 4 x 4 patches to ``mm_tokens_per_image`` (256 by default: a pooling kernel of 0).
    dbrx: ``ffn_config.hidden_size`` copies ``d_model`` before the tiny width reaches it.
    """
    model = build_tiny_model(model_type)
    report = _zero_config(model)
    zc = report.zero_config
    assert zc.source == "measured" and zc.patched and not zc.failed, str(report)


def test_a_model_that_rebuilds_itself_in_its_first_forward_is_verified_on_the_settled_model() -> None:
    """BigBird switches block-sparse attention to full attention on a short sequence, in its first forward.

    It builds new attention modules there, whose initialisation draws from the global generator
    after the run's seed: the original's first run drew other dropout masks than every later run,
    and differed from the patched run (logits by 3) by those masks, not by the patch.
    """
    model = build_tiny_model("big_bird")
    assert model.training and model.config.attention_type == "block_sparse"
    patched = copy.deepcopy(model)
    report = engine.apply(patched)  # its verification runs the first forward of this copy
    assert report.zero_config.source == "measured" and report.patched, str(report)
    assert engine.verify(patched, raise_on_failure=False).passed
    with torch.no_grad():  # the unpatched model's own first forward, so that both compare settled
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    _assert_same_numbers(model, patched)


def test_a_norm_class_with_weightless_instances_is_measured_and_patched_on_all_of_them() -> None:
    """Gemma 3n's RMSNorm has no weight in its value norm (``with_scale=False``): measured with
    ``weight_required: false`` from that instance's layout, all 22 are patched, the weightless ones too."""
    model = build_tiny_model("gemma3n_text")
    report = _zero_config(model)
    assert any(line.startswith("Gemma3nRMSNorm: rms_norm") for line in report.zero_config.patched), str(report)
    patched = copy.deepcopy(model)
    engine.apply(patched)
    verdict = engine.verify(patched, modules="all", raise_on_failure=False)
    bare = [c for c in verdict.checks if c.path.endswith("v_norm")]
    assert bare and all(c.passed for c in bare), verdict
