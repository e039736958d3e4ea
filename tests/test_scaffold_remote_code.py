"""The scaffold measures every class and function, wherever its code lives.

A checkpoint folder with its own code (``config.json`` with ``auto_map``, loaded with
``trust_remote_code=True``, written here by tests/remote_checkpoint.py; no hub access): its
norm computes ``(1 + weight)`` in fp32, its MLP has Mistral's projection names and it has
its own ``apply_rotary_pos_emb``. ``patch-engine scaffold --model FOLDER`` writes a patchset
for them; applied to the checkpoint as a user loads it, it verifies, routes the function
inside the dynamic module ``transformers_modules.*``, reverts exactly and pickles. A user's
own classes in a plain Python module (this file) are measured the same way, and a norm that
fits no declaration is reported, never dropped. Every number is judged against the
unpatched model.
"""

from __future__ import annotations

import copy
import io
import re
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
import yaml
from remote_checkpoint import MODEL_TYPE, isolated_modules_cache, load_checkpoint, write_checkpoint
from snapshots import assert_same, snapshot
from torch import nn
from training_helpers import grads, max_diff

import engine
from engine.commands.cli import main
from engine.errors import InvalidArgument, ModelTypeMismatch, VerificationFailed
from engine.loader import load_patchset
from engine.runtime import routing
from engine.tiny import build_tiny_model
from engine.tiny.config import derive_tiny_config

TOL = 1e-5


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """``(folder, scaffolded YAML path)``: the checkpoint, and what ``patch-engine scaffold --model`` wrote."""
    root = tmp_path_factory.mktemp("remote_code")
    with isolated_modules_cache(root):
        folder = write_checkpoint(root / "toyllama_ckpt")
        out = root / "toyllama.yaml"
        err = io.StringIO()
        with redirect_stdout(io.StringIO()), redirect_stderr(err):
            code = main(["scaffold", "--model", str(folder), "--trust-remote-code", "--out", str(out)])
        assert code == 0, err.getvalue()
        yield folder, out


def _numbers(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), grads(model)


def _assert_same_numbers(a, b) -> None:  # type: ignore[no-untyped-def]
    assert (a[0] - b[0]).abs().max().item() <= TOL
    assert abs(a[1].item() - b[1].item()) <= TOL
    assert max_diff(a[2], b[2]) <= TOL


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def test_scaffold_of_a_remote_code_folder_declares_its_own_classes_and_function(remote) -> None:
    _, path = remote
    text = path.read_text()
    ps = load_patchset(str(path))  # valid against the schema
    assert ps.model_types == [MODEL_TYPE]  # its own type, which no bundled patchset names
    assert ps.tiny_model is None and "`patch-engine verify` cannot build it" in text
    decl = {getattr(p, "target", None) or p.function: p.model_dump(mode="json") for p in ps.patches}
    assert decl["ToyRMSNorm"]["scale"] == "one_plus_weight" and decl["ToyRMSNorm"]["cast"] == "fp32"
    assert decl["ToyRMSNorm"]["eps_attr"] == "eps"
    assert {k: decl["ToyFeedForward"][k] for k in ("op", "gate_proj", "up_proj", "down_proj", "act_attr")} == {
        "op": "swiglu", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "act_attr": "act"}
    assert decl["apply_rotary_pos_emb"]["op"] == "rope" and decl["apply_rotary_pos_emb"]["layout"] == "half"
    # the classes and function say where their code lives
    assert re.search(r"# ToyRMSNorm \(5 modules, from transformers_modules\.toyllama_ckpt\.\w+\.modeling_toyllama\)", text)
    # head- and rope-like classes no op patches get a line saying why
    assert re.search(r"# not patched: ToyLlamaForCausalLM \(.*\): fused_linear_cross_entropy: .* logits_to_keep", text)
    assert re.search(r"# not patched: ToyRotaryEmbedding \(.*\): .* the rope op patches the function that applies "
                     r"them \(apply_rotary_pos_emb", text)


def test_the_scaffolded_patchset_applies_verifies_routes_and_reverts(remote) -> None:
    folder, path = remote
    model = load_checkpoint(folder)
    namespace = type(model.model.layers[0].attn).forward.__globals__["__name__"]
    assert namespace.startswith("transformers_modules.")
    reference = copy.deepcopy(model)
    before = snapshot(model)
    ids = _ids()
    expected = _numbers(reference, ids)
    engine.apply(model, str(path))
    report = engine.verify(model)
    assert report.passed
    # the function is routed in the dynamic module, and the patched model's forwards reach it
    router = routing.router_for(namespace, "apply_rotary_pos_emb")
    assert router is not None and vars(sys.modules[namespace])["apply_rotary_pos_emb"] is router.function
    calls: list[int] = []
    router.observers.append(lambda args, kwargs: calls.append(1))
    try:
        got = _numbers(model, ids)
    finally:
        router.observers.clear()
    assert len(calls) == 2  # one attention per layer
    _assert_same_numbers(got, expected)
    engine.revert(model)
    assert_same(before, snapshot(model))
    assert routing.router_for(namespace, "apply_rotary_pos_emb") is None
    assert vars(sys.modules[namespace])["apply_rotary_pos_emb"] is router.original


def test_the_routed_kernel_is_what_runs_and_only_for_the_patched_model(remote, tmp_path: Path) -> None:
    # Declare the interleaved layout: if the router reached the original function, nothing would
    # change; the logits move, verify names the function, and another instance is untouched.
    folder, path = remote
    data = yaml.safe_load(path.read_text())
    data["patches"] = [p for p in data["patches"] if p.get("function") == "apply_rotary_pos_emb"]
    data["patches"][0]["layout"] = "interleaved"
    model, other = load_checkpoint(folder), load_checkpoint(folder)
    ids = _ids()
    with torch.no_grad():
        before = model(input_ids=ids).logits
    engine.apply(model, data, unverified="trust")  # wrong on purpose (by default refused on a tiny copy of its classes)
    try:
        with torch.no_grad():
            assert (model(input_ids=ids).logits - before).abs().max().item() > 1e-2
            assert torch.equal(other(input_ids=ids).logits, before)
        with pytest.raises(VerificationFailed, match="apply_rotary_pos_emb"):
            engine.verify(model)
    finally:
        engine.revert(model)


def test_a_wrong_declaration_fails_verify_naming_the_class(remote, tmp_path: Path) -> None:
    folder, path = remote
    wrong = tmp_path / "wrong.yaml"
    text = path.read_text()
    assert "scale: one_plus_weight" in text
    wrong.write_text(text.replace("scale: one_plus_weight", "scale: weight"))
    model = load_checkpoint(folder)
    before = snapshot(model)
    with pytest.raises(VerificationFailed) as info:
        engine.apply(model, str(wrong), verify=True)
    assert "ToyRMSNorm" in str(info.value) and "scale: weight" in str(info.value)
    assert_same(before, snapshot(model))  # refused: the model is as it was


@pytest.mark.parametrize("roundtrip", ["torch.save", "deepcopy"])
def test_a_patched_remote_code_model_pickles_and_comes_back_patched(remote, roundtrip: str) -> None:
    folder, path = remote
    model = load_checkpoint(folder)
    ids = _ids()
    expected = _numbers(copy.deepcopy(model), ids)
    engine.apply(model, str(path))
    if roundtrip == "torch.save":
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    else:
        loaded = copy.deepcopy(model)
    try:
        assert engine.is_patched(loaded)
        _assert_same_numbers(_numbers(loaded, ids), expected)
        assert engine.verify(loaded).passed
    finally:
        engine.revert(loaded)
        engine.revert(model)
    assert not engine.is_patched(loaded)
    _assert_same_numbers(_numbers(loaded, ids), expected)


def test_remote_code_runs_only_when_trusted(remote) -> None:
    folder, _ = remote
    err = io.StringIO()
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        assert main(["scaffold", "--model", str(folder)]) == 2
    message = err.getvalue()
    assert "holds its own model code" in message and "modeling_toyllama.py" in message
    assert "--trust-remote-code" in message
    with pytest.raises(InvalidArgument, match="trust_remote_code=True"):
        engine.scaffold(folder)
    with redirect_stdout(io.StringIO()), redirect_stderr(err):
        assert main(["scaffold", "--model", str(folder.parent / "missing")]) == 2
    assert "no such folder" in err.getvalue()


def test_bundled_patchsets_refuse_a_remote_code_model(remote) -> None:
    # Its own model_type: the bundled llama patchset is for another type, and the error says what to do.
    folder, _ = remote
    model = load_checkpoint(folder)
    with pytest.raises(ModelTypeMismatch, match="'toyllama'") as info:
        engine.apply(model, "llama")
    assert f"patch-engine scaffold --model {folder} --trust-remote-code" in str(info.value)  # runnable as printed
    # Its own code under transformers' names and type: the bundled declaration would be wrong
    # ((1 + w) norm named LlamaRMSNorm); it is refused before anything changes. (Written beside
    # the first checkpoint: one modules cache per test module.)
    twin = write_checkpoint(folder.parent / "llama_lookalike", model_type="llama", renames={"ToyRMSNorm": "LlamaRMSNorm"})
    lookalike = load_checkpoint(twin)
    assert lookalike.config.model_type == "llama"
    before = snapshot(lookalike)
    with pytest.raises(ModelTypeMismatch, match=r"class LlamaRMSNorm comes from its own code \(transformers_modules") as own:
        engine.apply(lookalike, "llama")
    assert "engine.apply(model)" in str(own.value) and "FOLDER" not in str(own.value)  # what to do instead, runnable
    assert_same(before, snapshot(lookalike))


# ------------------------------------------------------------------------ a user's own classes


class OnePlusRMSNorm(nn.Module):
    """A user's norm: ``(1 + weight)``, all in fp32 (Gemma's parameterization), in a plain module."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.detach() - 1.0)  # near 0, as trained (1 + w) norms are
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x * (1.0 + self.weight.float())).to(hidden_states.dtype)


class LiteralEpsNorm(nn.Module):
    """A norm with its eps written inside forward: nothing a declaration could name."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight).to(hidden_states.dtype)


class MeanAbsNorm(nn.Module):
    """A norm no op computes (by the mean absolute value): measured, and the closest miss reported."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone())
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.float()
        return (x / (x.abs().mean(-1, keepdim=True) + self.eps) * self.weight).to(hidden_states.dtype)


def _llama_with_user_norms() -> nn.Module:
    model = build_tiny_model("llama", derive_tiny_config("llama"), seed=2)
    for layer in model.model.layers:
        old = layer.input_layernorm
        layer.input_layernorm = OnePlusRMSNorm(old.weight, old.variance_epsilon)
        layer.post_attention_layernorm = LiteralEpsNorm(layer.post_attention_layernorm.weight)
    model.model.norm = MeanAbsNorm(model.model.norm.weight, model.model.norm.variance_epsilon)
    return model


def test_a_users_own_classes_are_measured_and_every_norm_is_reported(tmp_path: Path) -> None:
    model = _llama_with_user_norms()
    text = engine.scaffold(model).to_yaml()
    here = __name__
    assert f"# OnePlusRMSNorm (2 modules, from {here}): fp32 exact, bf16 exact" in text
    assert "target: OnePlusRMSNorm\n    op: rms_norm\n    scale: one_plus_weight\n    eps_attr: eps\n    cast: fp32" in text
    # its eps is a literal in forward: reported, never declared (layer_norm's literal-eps candidates miss it too)
    assert f"# not patched: LiteralEpsNorm (2 modules, from {here}): " in text and "target: LiteralEpsNorm" not in text
    assert f"# not patched: MeanAbsNorm (1 module, from {here}): closest is rms_norm" in text
    # transformers' own classes beside them are still found
    assert "target: LlamaMLP" in text and "function: apply_rotary_pos_emb" in text
    # a llama built from its type would not have these classes: no tiny_model block
    assert "tiny_model:" not in text and f"({here})," in text
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    reference = copy.deepcopy(model)
    ids = _ids()
    engine.apply(model, str(path), verify=True)  # as the file's header says: no tiny_model, verified on the model itself
    try:
        assert engine.verify(model).passed
        _assert_same_numbers(_numbers(model, ids), _numbers(reference, ids))
    finally:
        engine.revert(model)


def test_a_transformers_checkpoint_folder_gets_a_tiny_model_block_that_verifies(tmp_path: Path) -> None:
    # Code transformers has: the folder's config, shrunk, is written as tiny_model, so
    # `patch-engine verify` rebuilds the measured model from the file alone.
    build_tiny_model("qwen3", {"head_dim": 16}, seed=4).save_pretrained(tmp_path / "qwen3_ckpt")
    out = tmp_path / "q.yaml"
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        assert main(["scaffold", "--model", str(tmp_path / "qwen3_ckpt"), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith(f"# Generated by `patch-engine scaffold --model {tmp_path / 'qwen3_ckpt'}`")
    ps = load_patchset(str(out))
    assert ps.model_types == ["qwen3"] and ps.tiny_model is not None and ps.tiny_model.config["head_dim"] == 16
    assert {getattr(p, "target", None) or p.function for p in ps.patches} == {
        "Qwen3RMSNorm", "Qwen3MLP", "apply_rotary_pos_emb"}
    with redirect_stdout(io.StringIO()) as printed, redirect_stderr(io.StringIO()):
        assert main(["verify", str(out)]) == 0, printed.getvalue()[-2000:]
