"""The version refusal comes first: a patchset not for the installed transformers is refused as such.

Under ``unverified_release="refuse"`` (set for this whole file through the engine's environment
variable; the default, ``verify``, is tests/test_release_self_verify.py), before anything is built
or loaded, every entry point (``engine.plan`` / ``apply``, ``patch-engine plan|verify|scaffold|coverage``,
a checkpoint's verification and benchmark) answers a patchset whose ``requires`` leaves out the
installed release with :class:`VersionMismatch` naming the verified range and the installed
version, not with whatever breaks first (an unknown model type, a tiny model transformers cannot
build, a missing file). A bundled patchset whose model type the release lacks is refused so under
any policy.

The first tests run under any release (a patchset of their own claims a range that excludes it).
The last ones need a release older than the bundled ``deepseek_v32`` and ``paligemma`` ranges:
CI runs this file under transformers 5.6.0 too (``.ci/matrix``); under the suite's they skip. There
the default policy is checked too: it cannot verify a patchset whose tiny model the release cannot
build, and says so with the range.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
from packaging.version import Version
from snapshots import assert_same, snapshot

import engine
from engine.commands.cli import EXIT_FAILED, main
from engine.foundation.versions import in_range
from engine.loader import load_patchset
from engine.tiny import build_tiny_model

INSTALLED = Version(transformers.__version__)


@pytest.fixture(autouse=True)
def refuse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATCH_ENGINE_UNVERIFIED_RELEASE", "refuse")
NOT_NOW = f"<{INSTALLED.major}.0"  # a range that leaves out the installed release


def _not_now(tmp_path: Path, *, model_type: str = "qwen3", tiny: str = "") -> Path:
    """A patchset verified on no release installed here; ``tiny`` a tiny_model block that would fail to build."""
    path = tmp_path / "elsewhere.yaml"
    path.write_text(
        f"name: elsewhere\nmodel_types: [{model_type}]\nrequires: {{transformers: '{NOT_NOW}'}}\n{tiny}"
        "patches:\n  - {target: Qwen3MLP, op: swiglu}\n",
        encoding="utf-8",
    )
    return path


def _says_the_version(text: str, name: str = "elsewhere", spec: str = NOT_NOW) -> None:
    assert f"patchset {name!r} requires transformers{spec}; installed is {INSTALLED}" in text, text


@pytest.mark.parametrize("command", ["verify", "plan"])
def test_cli_refuses_the_version_before_building_the_tiny_model(tmp_path: Path, command: str, capsys) -> None:
    # head_dim 0 would be a PatchsetError from building; an unknown model type a usage error
    for path in (_not_now(tmp_path, tiny="tiny_model: {config: {head_dim: 0}}\n"),
                 _not_now(tmp_path, model_type="no_such_model_type")):
        assert main([command, str(path)]) == EXIT_FAILED
        err = capsys.readouterr().err
        _says_the_version(err)
        assert "head_dim" not in err and "unknown model type" not in err


def test_plan_refuses_the_version_before_the_model_type(tmp_path: Path) -> None:
    model = build_tiny_model("llama", {})  # not a qwen3: a ModelTypeMismatch, were the version not asked first
    before = snapshot(model)
    with pytest.raises(engine.VersionMismatch) as info:
        engine.apply(model, _not_now(tmp_path), device="cpu", verify=True)
    _says_the_version(str(info.value))
    assert_same(before, snapshot(model))
    assert not engine.is_patched(model)


def test_coverage_row_says_the_version(tmp_path: Path) -> None:
    from engine.commands.coverage import coverage_rows

    (row,) = coverage_rows(["qwen3"], patchsets={"qwen3": [str(_not_now(tmp_path))]})
    assert row.verified is False and row.note.startswith("VersionMismatch: ")
    _says_the_version(row.note)


def test_a_checkpoint_is_not_loaded_for_a_patchset_of_another_release(tmp_path: Path) -> None:
    from engine.commands.bench_checkpoint import run_cli
    from engine.commands.checkpoint import verify_checkpoint_files

    missing = str(tmp_path / "no-such-checkpoint")  # loading it would fail with its own error
    with pytest.raises(engine.VersionMismatch) as info:
        verify_checkpoint_files(str(_not_now(tmp_path)), model=missing)
    _says_the_version(str(info.value))
    with pytest.raises(engine.VersionMismatch):
        run_cli(None, None, missing, str(_not_now(tmp_path)), tmp_path / "out", 8, 8, 1, "test")
    assert not (tmp_path / "out").exists()


def test_a_bundled_patchset_whose_model_type_the_release_lacks_is_a_version_mismatch() -> None:
    from engine.runtime.release import check_release

    qwen3 = load_patchset("qwen3")
    moved = qwen3.model_copy(update={"model_types": ["qwen3_from_the_future"]})
    moved._files, moved._origins = qwen3._files, qwen3._origins  # still the bundled file
    with pytest.raises(engine.VersionMismatch) as info:
        check_release(moved)
    text = str(info.value)
    assert "model type 'qwen3_from_the_future'" in text and f"transformers {INSTALLED} does not define" in text
    assert f"verified on transformers{qwen3.requires.transformers}" in text
    check_release(qwen3)  # the bundled one itself is for this release


def _outside(name: str):
    spec = load_patchset(name).requires.transformers
    return pytest.mark.skipif(in_range(spec, str(INSTALLED)),
                              reason=f"{name} is verified on transformers {INSTALLED} (CI runs this under 5.6.0)")


@_outside("deepseek_v32")
@pytest.mark.parametrize("command", [["verify", "deepseek_v32"], ["plan", "deepseek_v32"], ["verify", "paligemma"],
                                     ["coverage", "deepseek_v32"]])
def test_an_older_release_gets_the_version_not_a_model_type_or_build_error(command: list[str], capsys) -> None:
    name = command[1]
    code = main(command)
    out = capsys.readouterr()
    text = out.err + out.out
    assert code == EXIT_FAILED
    if command[0] == "coverage":  # a row that does not verify, saying why
        assert "VersionMismatch: " in text
    _says_the_version(" ".join(text.split()), name, load_patchset(name).requires.transformers)
    assert "did you mean" not in text and "token_type_ids" not in text


@_outside("deepseek_v32")
def test_scaffold_of_a_type_only_newer_releases_define_names_the_bundled_range(capsys) -> None:
    if "deepseek_v32" in transformers.CONFIG_MAPPING:
        pytest.skip("this release defines deepseek_v32")
    assert main(["scaffold", "deepseek_v32"]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert f"which transformers {INSTALLED} does not define" in err and "did you mean" not in err
    assert f"verified on transformers{load_patchset('deepseek_v32').requires.transformers}" in err


@_outside("paligemma")
def test_apply_on_an_older_release_refuses_before_patching() -> None:
    tiny = load_patchset("paligemma").tiny_model
    model = build_tiny_model("paligemma", dict(tiny.config) if tiny else {})
    before = snapshot(model)
    with pytest.raises(engine.VersionMismatch) as info:
        engine.apply(model, "paligemma", device="cpu")
    _says_the_version(str(info.value), "paligemma", load_patchset("paligemma").requires.transformers)
    assert_same(before, snapshot(model))


@_outside("paligemma")
@pytest.mark.parametrize("name", ["deepseek_v32", "paligemma"])
def test_under_the_default_policy_an_older_release_is_refused_with_the_range_and_why(
        name: str, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setenv("PATCH_ENGINE_UNVERIFIED_RELEASE", "verify")
    spec = load_patchset(name).requires.transformers
    assert main(["verify", name]) == EXIT_FAILED
    text = " ".join(capsys.readouterr().err.split())
    if name == "deepseek_v32" and "deepseek_v32" not in transformers.CONFIG_MAPPING:  # nothing to verify on
        assert f"which transformers {INSTALLED} does not define" in text and f"transformers{spec}" in text
    else:  # the release builds no tiny model of it: nothing can verify it there
        assert f"transformers {INSTALLED} is outside the range patchset {name!r} is verified on" in text
        assert "cannot be built" in text and "nothing was patched" in text
