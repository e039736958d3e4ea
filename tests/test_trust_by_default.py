"""Nothing unverified patches by default (issue 38): a user's own patchset is verified before it patches.

The founding bug: a copy of the bundled ``qwen3.yaml`` with ``scale: one_plus_weight`` on the
norms, kept *inside* its ``requires`` range, patched silently (logits off by 3.4-6.9). Content now
patches without a verification only where it is known verified on the installed release: bundled
content as CI verified it (engine/_data/verified_content.json), or a passing verdict of its own
in the cache. Everything else is verified first on a tiny model of the *user's* model type.

Real tiny transformers models (perturbed weights), real files in ``tmp_path``, the real verifier,
a verdict cache of each test's own.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
import yaml
from conftest import own_verdict_cache, tiny_for
from snapshots import assert_same, snapshot

import engine
from engine.commands.cli import EXIT_FAILED, EXIT_OK, main
from engine.loader import load_patchset
from engine.releases import self_verify
from engine.tiny import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent
QWEN3 = (ROOT / "patchsets" / "qwen3.yaml").read_text(encoding="utf-8")
NORM_LINE = next(i for i, line in enumerate(QWEN3.splitlines(), 1) if "target: Qwen3RMSNorm" in line)


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty verdict cache of this test's own, and no setting from the environment."""
    return own_verdict_cache(tmp_path, monkeypatch)


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The model types of the tiny models self-verification builds (observed, not replaced)."""
    seen: list[str] = []
    original = self_verify.tiny_for_type

    def observed(patchset: Any, model_type: str, **kwargs: Any) -> torch.nn.Module:
        seen.append(model_type)
        return original(patchset, model_type, **kwargs)

    monkeypatch.setattr(self_verify, "tiny_for_type", observed)
    return seen


def _file(tmp_path: Path, text: str, name: str = "my_qwen3.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def _flipped() -> str:
    """qwen3.yaml with the mistake that doubled a Qwen3-8B loss; its `requires` still holds the installed release."""
    return QWEN3.replace("    scale: weight\n", "    scale: one_plus_weight\n", 1)


def _twin() -> str:
    """qwen3.yaml, correct, under another name: a user's own content (CI never verified it)."""
    return QWEN3.replace("name: qwen3\n", "name: my_qwen3\n", 1)


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "release-verdicts").glob("*.json"))


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _apply(model: torch.nn.Module, patchset: Any, **kwargs: Any) -> tuple[Any, list[str]]:
    """``engine.apply`` on the CPU; the report and what it said: UnverifiedContentWarnings, then the info lines of a
    passed self-verification (a pass is news, not a warning: asserted here, never both)."""
    said, log = _Said(), logging.getLogger("engine.releases")
    log.addHandler(said)
    level = log.level
    log.setLevel(logging.INFO)  # setLevel, not .level =: it clears the logger's cached isEnabledFor
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = engine.apply(model, patchset, device="cpu", **kwargs)
    finally:
        log.removeHandler(said)
        log.setLevel(level)
    warned = [str(w.message) for w in caught if issubclass(w.category, engine.UnverifiedContentWarning)]
    assert not (warned and said.lines) and not any("verified there first: passed" in w for w in warned), warned
    return report, warned + said.lines


def test_a_users_flipped_file_inside_its_range_is_refused_by_default_with_file_and_line(
        tmp_path: Path, cache: Path) -> None:
    path = _file(tmp_path, _flipped())
    assert load_patchset(path).requires.transformers and engine.plan(tiny_for("qwen3"), path, device="cpu").release \
        is None  # inside its range: before issue 38, nothing checked it
    model = tiny_for("qwen3")
    before = snapshot(model)
    with pytest.raises(engine.SelfVerificationFailed) as info:
        engine.apply(model, path, device="cpu")
    text = str(info.value)
    assert f"{path}:{NORM_LINE}" in text and "patches[0] (Qwen3RMSNorm)" in text  # the patch that does not fit
    assert "declared scale: one_plus_weight" in text and "scale: weight fits" in text  # the finding
    assert f"patch-engine verify {path.resolve()}" in text  # a command that works as printed, from anywhere
    assert not isinstance(info.value, engine.VersionMismatch)  # the release is not the cause
    assert not engine.is_patched(model)
    assert_same(before, snapshot(model))
    (entry,) = _entries(cache)  # a verdict: the next apply refuses from the cache
    with pytest.raises(engine.SelfVerificationFailed, match="from an earlier apply"):
        engine.apply(model, path, device="cpu")


def test_its_correct_twin_is_verified_once_then_served_from_the_cache(
        tmp_path: Path, cache: Path, built: list[str]) -> None:
    reference, model = tiny_for("qwen3"), tiny_for("qwen3")
    path = _file(tmp_path, _twin())
    report, said = _apply(model, path)
    verdict = report.release
    assert verdict.passed and not verdict.cached and verdict.checks > 0 and verdict.model_type == "qwen3"
    assert built == ["qwen3"] and len(said) == 1 and "verified there first: passed" in said[0]
    assert "a patchset of your own" in said[0] and str(cache) in said[0]
    batch = {"input_ids": torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))}
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, reference(**batch).logits)  # torch kernels: bit-equal
    engine.revert(model)
    report, said = _apply(model, path)  # the second apply: a file read, no tiny model, no warning
    assert report.release.cached and report.release.passed and built == ["qwen3"] and said == []
    assert engine.is_patched(model) and len(_entries(cache)) == 1


def test_bundled_content_is_not_verified_again_by_name_or_as_a_verbatim_copy(
        tmp_path: Path, cache: Path, built: list[str]) -> None:
    model = tiny_for("qwen3")
    assert engine.plan(model, "qwen3", device="cpu").verification.kind == "bundled"
    report, said = _apply(model, "qwen3")
    assert report.release is None and said == [] and built == [] and engine.is_patched(model)
    engine.revert(model)
    copy = _file(tmp_path, QWEN3, "qwen3_copy.yaml")  # the same content elsewhere: CI verified that content
    the_plan = engine.plan(model, copy, device="cpu")
    assert the_plan.verification.kind == "bundled" and "as CI verified it on transformers" in str(the_plan)
    report, said = _apply(model, copy)
    assert report.release is None and said == [] and built == [] and not cache.exists()


def test_an_edited_bundled_file_is_verified(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            built: list[str]) -> None:
    """The installed package's qwen3.yaml edited in place: no longer the content CI verified."""
    from engine.loader import names

    folder = tmp_path / "bundled"
    folder.mkdir()
    for source in (ROOT / "patchsets").glob("*.yaml"):
        (folder / source.name).write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    (folder / "qwen3.yaml").write_text(QWEN3.replace("Qwen3 dense models.", "Qwen3 dense models (edited).", 1),
                                       encoding="utf-8")
    monkeypatch.setattr(names, "bundled_dir", lambda: folder)
    model = tiny_for("qwen3")
    the_plan = engine.plan(model, "qwen3", device="cpu")
    assert the_plan.verification.kind == "verify" and "an edited bundled patchset" in str(the_plan)
    report, said = _apply(model, "qwen3")
    assert report.release.passed and not report.release.cached and built == ["qwen3"]
    assert "an edited bundled patchset" in said[0]


def _decoy(tmp_path: Path, requires: str) -> Path:
    """The issue's decoy: verified on a llama, where its flipped Qwen3 patch never installs."""
    text = f"""name: decoy
model_types: [qwen3, llama]
requires: {{transformers: "{requires}"}}
tiny_model: {{model_type: llama, config: {{head_dim: 16}}}}
patches:
  - target: LlamaRMSNorm
    op: rms_norm
    scale: weight
    optional: true
  - target: Qwen3RMSNorm
    op: rms_norm
    scale: one_plus_weight
    optional: true
"""
    return _file(tmp_path, text, "decoy.yaml")


@pytest.mark.parametrize("where", ["inside its range", "outside its range"])
def test_the_decoy_verified_on_another_type_is_refused_on_the_users_type(
        tmp_path: Path, built: list[str], where: str, capsys: pytest.CaptureFixture[str]) -> None:
    installed = transformers.__version__
    path = _decoy(tmp_path, f">={installed}" if where == "inside its range" else f"<{installed}")
    model = tiny_for("qwen3")
    before = snapshot(model)
    with pytest.raises(engine.SelfVerificationFailed) as info:
        engine.apply(model, path, device="cpu")
    assert built == ["qwen3"]  # the user's type, not the patchset's tiny llama
    text = str(info.value)
    line = next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if "target: Qwen3RMSNorm" in ln)
    assert "tiny qwen3 (Qwen3ForCausalLM)" in text and f"patches[1] (Qwen3RMSNorm) at {path}:{line}" in text
    assert isinstance(info.value, engine.VersionMismatch) == (where == "outside its range")
    assert_same(before, snapshot(model))
    if where == "inside its range":  # `patch-engine verify FILE` verifies every type the file lists
        assert main(["verify", str(path)]) == EXIT_FAILED
        out = capsys.readouterr().out
        assert "on a tiny qwen3" in out and "on a tiny llama" in out and "verification FAILED" in out


def test_a_patch_installed_on_the_users_model_that_did_not_run_in_the_tiny_model_fails(
        tmp_path: Path, built: list[str]) -> None:
    """qwen3_moe with a tiny model whose every layer is sparse: its dense-MLP patch never installs there."""
    text = (ROOT / "patchsets" / "qwen3_moe.yaml").read_text(encoding="utf-8")
    path = _file(tmp_path, text.replace("mlp_only_layers: [0]", "mlp_only_layers: []"), "all_sparse.yaml")
    model = tiny_for("qwen3_moe")  # the bundled tiny config: layer 0 is dense (Qwen3MoeMLP)
    with pytest.raises(engine.SelfVerificationFailed) as info:
        engine.apply(model, path, device="cpu")
    line = next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if "target: Qwen3MoeMLP" in ln)
    text = str(info.value)
    assert "did not run in the tiny model" in text and f"patches[1] (Qwen3MoeMLP) at {path}:{line}" in text
    assert not engine.is_patched(model)


def test_a_verification_that_could_not_run_is_neither_cached_nor_passed(tmp_path: Path, cache: Path) -> None:
    """A tiny model that cannot be built (3 heads of a 64-wide model) stops the verification: no verdict."""
    path = _file(tmp_path, _twin().replace("config: {head_dim: 16}", "config: {head_dim: 16, num_attention_heads: 3}"))
    model = tiny_for("qwen3")
    before = snapshot(model)
    for _ in range(2):  # not cached: the next apply tries again, and says the same
        with pytest.raises(engine.VerificationNotRun) as info:
            engine.apply(model, path, device="cpu")
        text = str(info.value)
        assert "could not run" in text and "no verdict was cached" in text and "neither a pass nor a failure" in text
        assert "tiny_model.config" in info.value.cause  # the cause, as the tiny model's build said it
        assert "verify=True" in text and "unverified='trust'" in text  # how to proceed
        assert not isinstance(info.value, engine.VerificationFailed)
        assert not _entries(cache) and not engine.is_patched(model)
    assert_same(before, snapshot(model))
    report, said = _apply(model, path, verify=True)  # the model's own verification stands for it
    assert report.verification.passed and not _entries(cache)


def test_plan_says_which_way_apply_goes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_for("qwen3")
    path = _file(tmp_path, _twin())
    assert "verification: none needed, bundled content 'qwen3'" in str(engine.plan(model, "qwen3", device="cpu"))
    first = engine.plan(model, path, device="cpu")
    assert first.verification.kind == "verify" and "apply verifies it first (a patchset of your own" in str(first)
    assert engine.plan(model, path, device="cpu", unverified="trust").verification.kind == "trust"
    assert engine.plan(model, path, device="cpu", unverified="refuse").verification.kind == "refuse"
    assert main(["plan", str(path)]) == EXIT_OK
    assert "apply verifies it first" in capsys.readouterr().out
    _apply(model, path)
    engine.revert(model)
    cached = engine.plan(model, path, device="cpu")
    assert cached.verification.kind == "cached" and "passed, so apply patches" in str(cached)
    assert not engine.is_patched(model)


def test_the_setting_by_its_new_and_old_names(tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    model = tiny_for("qwen3")
    path = _file(tmp_path, _flipped())
    for setting in ({"unverified": "refuse"}, {"unverified_release": "refuse"}):
        with pytest.raises(engine.UnverifiedContent, match=f"patch-engine verify {path.resolve()}"):
            engine.apply(model, path, device="cpu", **setting)
    for variable in ("PATCH_ENGINE_UNVERIFIED", "PATCH_ENGINE_UNVERIFIED_RELEASE"):
        monkeypatch.setenv(variable, "refuse")
        with pytest.raises(engine.UnverifiedContent):
            engine.apply(model, path, device="cpu")
        monkeypatch.delenv(variable)
    report, said = _apply(model, path, unverified_release="trust")  # the old name: trusted, with a warning
    assert engine.is_patched(model) and "patched without verifying it (unverified='trust')" in said[0]
    assert "patched without verifying it" in str(report) and not cache.exists()
    engine.revert(model)
    with pytest.raises(engine.InvalidArgument, match="disagree"):
        engine.apply(model, path, device="cpu", unverified="trust", unverified_release="refuse")
    assert main(["plan", str(path), "--unverified-release", "trust"]) == EXIT_OK  # the old flag
    assert "apply patches it without verifying" in capsys.readouterr().out
    assert main(["plan", str(path), "--unverified", "refuse"]) == EXIT_OK  # plan says; apply would refuse
    assert "apply refuses it" in capsys.readouterr().out


def test_refuse_applies_content_with_a_cached_pass_of_its_own(tmp_path: Path) -> None:
    model = tiny_for("qwen3")
    path = _file(tmp_path, _twin())
    _apply(model, path)  # verified once (the default)
    engine.revert(model)
    report, said = _apply(model, path, unverified="refuse")
    assert report.release.cached and report.release.passed and engine.is_patched(model) and said == []


def test_a_dict_is_a_users_patchset_and_its_messages_name_no_bundled_command() -> None:
    data = load_patchset("qwen3").model_dump(mode="json", exclude_none=True)
    data["patches"][0]["scale"] = "one_plus_weight"
    model = build_tiny_model("qwen3", dict(load_patchset("qwen3").tiny_model.config))
    with pytest.raises(engine.SelfVerificationFailed) as info:
        engine.apply(model, data, device="cpu")
    text = str(info.value)
    assert "built in memory" in text and "patch-engine verify qwen3" not in text and "engine.verify(" in text


def test_the_refusals_advice_works_as_printed(tmp_path: Path) -> None:
    """``unverified='refuse'`` says to apply once with ``unverified='verify'``; after that, refuse applies it."""
    path = _file(tmp_path, _twin())
    with pytest.raises(engine.UnverifiedContent) as info:
        engine.apply(tiny_for("qwen3"), path, device="cpu", unverified="refuse")
    assert "apply it once with unverified='verify'" in str(info.value)
    assert "records no verdict for your model" in str(info.value)  # the CLI shows checks; it is not the way
    _apply(tiny_for("qwen3"), path, unverified="verify")
    model = tiny_for("qwen3")
    report = engine.apply(model, path, device="cpu", unverified="refuse")
    assert engine.is_patched(model) and report.release.cached and report.release.passed


def test_trust_with_the_models_own_verification_does_not_say_it_was_not_verified(tmp_path: Path) -> None:
    path = _file(tmp_path, _twin())
    report, said = _apply(tiny_for("qwen3"), path, unverified="trust", verify=True)
    assert report.verification.passed and not any("without verifying" in line for line in said), said
