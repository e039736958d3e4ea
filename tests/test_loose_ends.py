"""Issue 45, item 5: the loose ends the red team found, each reproduced and held.

* Falcon with ``alibi: true`` never calls rope: the bundled rope patch is planned as skipped, with why,
  and apply + verify pass on the unpatched model's own numbers (not "never called").
* ``TargetNotFound`` / ``ModelTypeMismatch`` echo 100,000-character names and lists by their ends.
* An in-memory patchset nested 5,000 deep, or holding a generator, is a ``PatchsetError`` with its key path.
* A NUL byte (or a newline) in a user's path is escaped in messages, never printed raw.
* ``VerdictCacheWarning`` is said once per apply, not once per cache read.
* ``tiny_model.model_type: qwen33`` (a typo) is refused with file:line and "did you mean 'qwen3'?".
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import transformers
import yaml
from snapshots import assert_same, snapshot
from torch import nn

import engine
from engine.commands.cli import EXIT_OK, main
from engine.loader import load_patchset
from engine.planning.call_sites import never_calls
from engine.tiny import build_tiny_for, build_tiny_model

# ---- (a) a function the config never calls is not patched --------------------------------------------


def _numbers(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach().clone(), out.loss.detach().clone(), grads


def test_falcon_with_alibi_skips_rope_with_why_and_applies_and_verifies() -> None:
    model = build_tiny_model("falcon", {"alibi": True}).train()
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    logits, loss, grads = _numbers(model, ids)
    plan = engine.plan(model, "falcon", device="cpu")
    (rope,) = [d for d in plan.decisions if d.op == "rope"]
    assert rope.action == "skip" and "never called for this config" in rope.reason, rope.reason
    assert "self.config.alibi" in rope.reason and "True" in rope.reason, rope.reason  # which value rules it out
    engine.apply(model, "falcon", device="cpu")
    try:
        report = engine.verify(model)  # failed "never called" before
        assert report.passed, str(report)
        patched_logits, patched_loss, patched_grads = _numbers(model, ids)
        torch.testing.assert_close(patched_logits, logits, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(patched_loss, loss, rtol=1e-5, atol=1e-6)
        assert patched_grads.keys() == grads.keys()
        for name in grads:
            torch.testing.assert_close(patched_grads[name], grads[name], rtol=1e-4, atol=1e-6, msg=name)
    finally:
        engine.revert(model)
    assert torch.equal(_numbers(model, ids)[0], logits)


def test_rotary_falcon_still_gets_the_rope_patch() -> None:
    plan = engine.plan(build_tiny_model("falcon", {}), "falcon", device="cpu")
    (rope,) = [d for d in plan.decisions if d.op == "rope"]
    assert rope.action == "patch" and len(rope.site.callers) == 2 and "left out" not in rope.reason


def test_layers_that_never_call_rope_are_left_out_of_the_callers() -> None:
    config = {**load_patchset("smollm3").tiny_model.config, "no_rope_layers": [1, 0]}  # layer 1 uses no rope
    model = build_tiny_model("smollm3", config)
    plan = engine.plan(model, "smollm3", device="cpu")
    (rope,) = [d for d in plan.decisions if d.op == "rope"]
    assert rope.action == "patch" and rope.site.callers == ("model.layers.0.self_attn",), rope.site.callers
    assert "modules left out" in rope.reason and "self.use_rope = 0" in rope.reason, rope.reason
    engine.apply(model, "smollm3", device="cpu")
    try:
        assert engine.verify(model).passed
    finally:
        engine.revert(model)


def helper(x: torch.Tensor) -> torch.Tensor:
    return x + 1


class _Guarded(nn.Module):
    def __init__(self, use: Any, flag: bool = True):
        super().__init__()
        self.use = use
        self.config = SimpleNamespace(flag=flag, kind="a")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use and self.config.kind in ("a", "b"):
            x = helper(x)
        return x


class _Else(_Guarded):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if not self.config.flag else helper(x)


class _Unknown(_Guarded):
    def forward(self, x: torch.Tensor, n: int = 0) -> torch.Tensor:
        if n > 1:  # a local: unknown, so it may call it
            x = helper(x)
        return x


class _Training(_Guarded):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:  # flipped by model.train() after planning: never read
            x = helper(x)
        return x


class _TwoUses(_Guarded):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.use:
            x = helper(x)
        return helper(x)  # unguarded


def test_never_calls_reads_only_what_the_module_holds() -> None:
    assert "`if self.use and self.config.kind in ('a', 'b')` (here self.use = False" in never_calls(
        _Guarded(False), "helper")
    assert never_calls(_Guarded(True), "helper") is None
    assert never_calls(_Guarded(torch.ones(2)), "helper") is None  # a tensor's truth is not read
    assert "the `else` of `if not self.config.flag`" in never_calls(_Else(True, flag=False), "helper")
    assert never_calls(_Else(True, flag=True), "helper") is None
    assert never_calls(_Unknown(False), "helper") is None
    assert never_calls(_TwoUses(False), "helper") is None
    assert never_calls(_Training(True).eval(), "helper") is None
    assert never_calls(_Guarded(False), "other_function") is None


# ---- (b) long names and lists are echoed by their ends -------------------------------------------------


@pytest.fixture(scope="module")
def qwen3() -> nn.Module:
    return build_tiny_model("qwen3", dict(load_patchset("qwen3").tiny_model.config))


def _norm_patchset(**change: Any) -> dict[str, Any]:
    data = {"name": "x", "model_types": ["qwen3"],
            "patches": [{"target": "Qwen3RMSNorm", "op": "rms_norm", "scale": "weight"}]}
    data.update(change)
    return data


LONG = "Q" * 100_000


@pytest.mark.parametrize("case", ["model type", "100,000 model types", "target", "function"])
def test_target_not_found_and_model_type_mismatch_cap_what_they_echo(qwen3: nn.Module, case: str) -> None:
    data, error, start = {
        "model type": (_norm_patchset(model_types=[LONG]), engine.ModelTypeMismatch,
                       "patchset 'x' is for model_type QQ"),
        "100,000 model types": (_norm_patchset(model_types=[f"t{i}" for i in range(100_000)]), engine.ModelTypeMismatch,
                                "patchset 'x' is for model_type t0, t1, t2"),
        "target": (_norm_patchset(patches=[{"target": LONG, "op": "rms_norm", "scale": "weight"}]),
                   engine.TargetNotFound, "patches[0] (rms_norm) targets class 'QQ"),
        "function": (_norm_patchset(patches=[{"function": "f" * 100_000, "op": "rope"}]), engine.TargetNotFound,
                     "patches[0] (rope) targets function 'ff"),
    }[case]
    with pytest.raises(error) as info:
        engine.plan(qwen3, data, device="cpu")
    text = str(info.value)
    assert len(text) < 5_000 and "more characters]" in text, len(text)
    assert text.startswith(start), text[:200]
    if error is engine.ModelTypeMismatch:
        assert "this model (Qwen3ForCausalLM) is 'qwen3'" in text  # the point of the message survives the cut


# ---- (c) in-memory patchsets: only plain data, not too deep -------------------------------------------


def _nested(depth: int) -> dict[str, Any]:
    top: dict[str, Any] = {}
    here = top
    for _ in range(depth):
        here["x"] = {}
        here = here["x"]
    return top


def _cyclic() -> dict[str, Any]:
    data = _norm_patchset()
    data["patches"][0]["self"] = data
    return data


@pytest.mark.parametrize("case, key, says", [
    ("5,000 deep", "deep.x.x", "nested more than 50 levels deep"),
    ("holds itself", "patches[0].self.patches[0].self", "nested more than 50 levels deep"),
    ("generator", "patches[0].target", "a generator is not patchset data"),
    ("set", "model_types", "a set is not patchset data"),
    ("object key", "patches[0]", "a key of type object is not patchset data"),
])
def test_a_dict_that_is_not_plain_data_is_a_patchset_error_and_the_model_is_unchanged(
        qwen3: nn.Module, case: str, key: str, says: str) -> None:
    data = {
        "5,000 deep": _norm_patchset(deep=_nested(5_000)),
        "holds itself": _cyclic(),
        "generator": _norm_patchset(patches=[{"target": (c for c in "Qwen3RMSNorm"), "op": "rms_norm"}]),
        "set": _norm_patchset(model_types={"qwen3"}),
        "object key": _norm_patchset(patches=[{object(): 1, "target": "Qwen3RMSNorm", "op": "rms_norm"}]),
    }[case]
    with pytest.raises(engine.PatchsetError) as info:
        load_patchset(data)
    assert info.value.key.startswith(key) and says in info.value.problem, str(info.value)
    assert "patchset holds what YAML can write" in str(info.value) or "levels deep" in str(info.value) or (
        "keys are strings" in str(info.value))  # how to fix it
    before = snapshot(qwen3)
    with pytest.raises(engine.PatchsetError):
        engine.apply(qwen3, data, device="cpu")
    assert_same(before, snapshot(qwen3))
    assert not engine.is_patched(qwen3)


def test_tuples_and_validated_patches_still_load() -> None:
    base = load_patchset(_norm_patchset())
    data = _norm_patchset(model_types=("qwen3",), patches=[base.patches[0]])
    loaded = load_patchset(data)
    assert loaded.model_types == ["qwen3"] and loaded.patches[0] == base.patches[0]
    assert loaded.patches[0] is not base.patches[0]  # copied, as deepcopy did


# ---- (d) a NUL byte or a newline in a path is escaped ---------------------------------------------------


@pytest.mark.parametrize("source", ["a\x00b.yaml", "dir/a\x00b", "qw\x00en3", Path("a\x00b.yaml"),
                                    _norm_patchset(extends="b\x00.yaml")])
def test_a_nul_byte_in_a_path_is_escaped(source: Any) -> None:
    with pytest.raises(engine.PatchsetError) as info:
        load_patchset(source)
    text = str(info.value)
    assert "\x00" not in text and "\\x00" in text, repr(text)


def test_a_newline_in_a_file_name_does_not_split_the_message(tmp_path: Path) -> None:
    path = tmp_path / "two\nlines.yaml"
    path.write_text("name: x\nmodel_types: [qwen3]\npatches:\n  - {target: Qwen3RMSNorm, op: rms_norm, scale: w}\n")
    with pytest.raises(engine.PatchsetError) as info:
        load_patchset(path)
    text = str(info.value)
    assert "\n" not in text and f"{str(path)!r}:4: patches[0].scale:" in text, repr(text)


def test_a_nul_byte_in_a_scaffold_folder_is_escaped() -> None:
    with pytest.raises(engine.PatchError) as info:
        engine.scaffold(Path("/tmp/no\x00such"))
    assert "\x00" not in str(info.value) and "\\x00" in str(info.value)


# ---- (e) one VerdictCacheWarning per apply ---------------------------------------------------------------


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("PATCH_ENGINE_CACHE_DIR", str(folder))
    monkeypatch.delenv("PATCH_ENGINE_UNVERIFIED_RELEASE", raising=False)
    return folder


def _outside_range() -> dict[str, Any]:
    data = load_patchset("qwen3").model_dump(mode="json", exclude_none=True)
    data["requires"] = {"transformers": f"<{transformers.__version__}"}  # outside: self-verified and cached
    return data


def _cache_warnings(model: nn.Module, data: dict[str, Any]) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.apply(model, data, device="cpu")
    engine.revert(model)
    return [str(w.message) for w in caught if issubclass(w.category, engine.VerdictCacheWarning)]


@pytest.mark.parametrize("damage", ["not json", "edited", "group-writable folder"])
def test_a_cache_problem_is_said_once_per_apply(qwen3: nn.Module, cache: Path, damage: str) -> None:
    data = _outside_range()
    assert _cache_warnings(qwen3, data) == []  # verified, written
    (entry,) = sorted((cache / "release-verdicts").glob("*.json"))
    if damage == "not json":
        entry.write_text("\x00garbage")
    elif damage == "edited":
        stored = json.loads(entry.read_text())
        stored["finding"] = "edited"
        entry.write_text(json.dumps(stored))
    else:
        entry.parent.chmod(0o770)
    said = _cache_warnings(qwen3, data)
    assert len(said) == 1, said  # it was said twice: once per read (is it cached? then under the lock)
    if damage != "group-writable folder":  # the fresh verdict replaced the entry: nothing more to say
        assert _cache_warnings(qwen3, data) == []
        entry.write_text("\x00damaged again")
        assert len(_cache_warnings(qwen3, data)) == 1  # a new damage is said again


# ---- (f) tiny_model.model_type is honoured or refused ----------------------------------------------------


def _typo(tmp_path: Path, model_types: str = "[qwen3]") -> Path:
    path = tmp_path / "mine.yaml"
    path.write_text(f"name: mine\nmodel_types: {model_types}\ntiny_model:\n  model_type: qwen33\n  config: {{}}\n"
                    "patches:\n  - {target: Qwen3RMSNorm, op: rms_norm, scale: weight}\n", encoding="utf-8")
    return path


def test_a_misspelt_tiny_model_type_is_refused_at_load_with_its_line(tmp_path: Path) -> None:
    path = _typo(tmp_path)
    with pytest.raises(engine.PatchsetError) as info:
        load_patchset(path)
    error = info.value
    assert (error.file, error.line, error.key) == (str(path), 4, "tiny_model.model_type"), str(error)
    assert "'qwen33'" in error.problem and "did you mean 'qwen3'?" in error.problem, error.problem


def test_patch_engine_verify_refuses_it_instead_of_verifying_a_qwen3(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", str(_typo(tmp_path))]) != EXIT_OK
    err = capsys.readouterr().err
    assert "mine.yaml:4: tiny_model.model_type: 'qwen33'" in err and "did you mean 'qwen3'?" in err, err


def test_an_unknown_tiny_type_listed_in_model_types_is_refused_when_verifying(tmp_path: Path) -> None:
    patchset = load_patchset(_typo(tmp_path, "[qwen33]"))  # consistent, but no such transformers type
    with pytest.raises(engine.PatchsetError) as info:
        build_tiny_for(patchset)
    assert info.value.key == "tiny_model.model_type" and info.value.file == str(tmp_path / "mine.yaml")
    assert "unknown model type 'qwen33'" in str(info.value) and "'qwen3'" in str(info.value)


def test_a_tiny_model_type_among_model_types_is_honoured() -> None:
    assert load_patchset("llama4").tiny_model.model_type == "llama4_text"
    data = yaml.safe_load(Path(load_patchset("llama4").files[0]).read_text())
    assert load_patchset(data).tiny_model.model_type == "llama4_text"
