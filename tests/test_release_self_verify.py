"""A transformers release outside a patchset's verified range is verified there, not refused blindly (issue 31).

Every test here runs on the installed release with a patchset whose ``requires`` ends just below
it (``<INSTALLED``): exactly what every bundled patchset looked like the day transformers 5.25.0
came out. Real tiny models, the real verifier, a real cache folder per test (``tmp_path``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
import yaml
from snapshots import assert_same, snapshot

import engine
from engine.commands.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from engine.loader import load_patchset
from engine.releases.key import device_kind, key_material, key_of, library_versions
from engine.tiny import build_tiny_model

INSTALLED = transformers.__version__
BELOW = f"<{INSTALLED}"  # a verified range that ends just below the installed release
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty verdict cache of this test's own, and no policy from the environment."""
    folder = tmp_path / "cache"
    monkeypatch.setenv("PATCH_ENGINE_CACHE_DIR", str(folder))
    monkeypatch.delenv("PATCH_ENGINE_UNVERIFIED_RELEASE", raising=False)
    return folder


def _qwen3(**change: Any) -> dict[str, Any]:
    """The bundled qwen3 patchset's content with ``requires`` ending below the installed release."""
    data = load_patchset("qwen3").model_dump(mode="json", exclude_none=True)
    data["requires"] = {"transformers": BELOW}
    for key, value in change.items():
        data[key] = value
    return data


def _written(tmp_path: Path, data: dict[str, Any], name: str = "outside.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


def _tiny_qwen3() -> torch.nn.Module:
    return build_tiny_model("qwen3", dict(load_patchset("qwen3").tiny_model.config))


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "release-verdicts").glob("*.json"))


def _apply(model: torch.nn.Module, patchset: Any, **kwargs: Any) -> tuple[Any, list[str]]:
    """``engine.apply`` on the CPU; the report and what its UnverifiedReleaseWarnings said (others re-emitted)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = engine.apply(model, patchset, device="cpu", **kwargs)
    said = [str(w.message) for w in caught if issubclass(w.category, engine.UnverifiedReleaseWarning)]
    for w in caught:
        if not issubclass(w.category, engine.UnverifiedReleaseWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return report, said


def test_apply_outside_the_range_self_verifies_once_then_applies_from_the_cache(tmp_path: Path, cache: Path) -> None:
    reference = _tiny_qwen3()
    model = _tiny_qwen3()
    batch = {"input_ids": torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))}
    report, said = _apply(model, _written(tmp_path, _qwen3()))
    assert len(said) == 1 and f"installed {INSTALLED} is outside that range" in said[0], said
    assert "verified there first: passed" in said[0] and str(cache) in said[0]
    verdict = report.release
    assert verdict.passed and not verdict.cached and verdict.installed == INSTALLED and verdict.checks > 0
    assert engine.is_patched(model) and len(report.patched) == 12
    assert f"installed {INSTALLED} is outside" in str(report) and report.to_dict()["release"]["passed"] is True
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, reference(**batch).logits)  # torch kernels: bit-equal
    (entry,) = _entries(cache)
    stamp = entry.stat().st_mtime_ns
    engine.revert(model)

    report, said = _apply(model, _written(tmp_path, _qwen3()))  # a second apply: a lookup
    assert report.release.cached and report.release.passed and len(said) == 1
    assert f"verdict read from {entry}" in said[0]
    assert _entries(cache) == [entry] and entry.stat().st_mtime_ns == stamp


def test_a_model_built_on_the_meta_device_is_self_verified_on_a_tiny_model_of_its_own(tmp_path: Path, cache: Path) -> None:
    """FSDP2's meta init and transformers' ``from_pretrained`` build a model inside ``torch.device("meta")``, its
    dtype torch's default: the tiny model the release is verified on was built there too, failed ("Cannot copy out
    of meta tensor"), and that failure was cached as the release's verdict, refusing every later apply."""
    model = _tiny_qwen3().to("meta")
    default = torch.get_default_dtype()
    with torch.device("meta"):
        torch.set_default_dtype(torch.bfloat16)
        try:
            report, said = _apply(model, _written(tmp_path, _qwen3()))
            assert torch.get_default_dtype() == torch.bfloat16 and torch.empty(1).device.type == "meta"  # restored
        finally:
            torch.set_default_dtype(default)
    assert report.release.passed and report.release.checks > 0 and "verified there first: passed" in said[0], said
    assert engine.is_patched(model) and len(report.patched) == 12
    (entry,) = _entries(cache)
    assert json.loads(entry.read_text())["passed"] is True
    on_cpu = _tiny_qwen3()
    report, _ = _apply(on_cpu, _written(tmp_path, _qwen3()))  # the cached verdict serves the CPU model too
    assert report.release.cached and report.release.passed and engine.is_patched(on_cpu)


def test_self_verification_leaves_the_callers_random_state_as_it_was(tmp_path: Path) -> None:
    """The tiny model is built seeded; the user's ``set_seed(42)`` must still decide their dropout and data order."""
    model = _tiny_qwen3()
    torch.manual_seed(42)
    before = torch.get_rng_state()
    report, said = _apply(model, _written(tmp_path, _qwen3()))
    assert report.release.passed and not report.release.cached and "verified there first" in said[0]  # it ran
    assert torch.equal(torch.get_rng_state(), before)


def test_a_flipped_declaration_is_refused_with_the_finding_and_the_model_is_untouched(tmp_path: Path) -> None:
    data = _qwen3()
    data["patches"][0]["scale"] = "one_plus_weight"  # Qwen3RMSNorm scales by weight
    model = _tiny_qwen3()
    before = snapshot(model)
    for attempt in ("fresh", "cached"):
        with pytest.raises(engine.ReleaseVerificationFailed) as info:
            engine.apply(model, data, device="cpu")
        text = str(info.value)
        assert f"installed is {INSTALLED}, outside that range, and verifying it on {INSTALLED} failed" in text
        assert "(Qwen3RMSNorm): declaration of rms_norm failed" in text
        assert "declared scale: one_plus_weight" in text and "scale: weight fits" in text
        assert ("from an earlier apply" in text) == (attempt == "cached")
        assert isinstance(info.value, engine.VersionMismatch) and isinstance(info.value, engine.VerificationFailed)
        assert info.value.verdict.passed is False and "one_plus_weight" in info.value.finding
        assert not engine.is_patched(model)
        assert_same(before, snapshot(model))


def _mamba2_before_5_23() -> dict[str, Any]:
    """mamba2's patchset as it was before transformers 5.23: the gated norm over all features, no groups.

    The target is the class of the installed release (``Mamba2RMSNormGated`` since 5.25), so the
    structural checks pass and only the numbers can tell: 5.23 made the norm per group.
    """
    data = yaml.safe_load((ROOT / "patchsets" / "mamba2.yaml").read_text(encoding="utf-8"))
    old = next(p for p in data["patches"] if p.get("when") == {"transformers": "<5.23"})
    modeling = __import__("transformers.models.mamba2.modeling_mamba2", fromlist=["_"])
    old = {k: v for k, v in old.items() if k != "when"}
    old["target"] = "Mamba2RMSNormGated" if hasattr(modeling, "Mamba2RMSNormGated") else "MambaRMSNormGated"
    data["patches"] = [data["patches"][0], old]
    data["requires"] = {"transformers": ">=5.0,<5.23"}
    data["name"] = "mamba2_before_5_23"
    return data


@pytest.mark.skipif(tuple(int(x) for x in INSTALLED.split(".")[:2]) < (5, 23), reason="the norm is grouped since 5.23")
def test_a_release_that_changed_the_numbers_is_refused_mamba2_grouped_gated_norm() -> None:
    data = _mamba2_before_5_23()
    tiny = load_patchset(data).tiny_model
    model = build_tiny_model("mamba2", dict(tiny.config))
    before = snapshot(model)
    with pytest.raises(engine.ReleaseVerificationFailed) as info:
        engine.apply(model, data, device="cpu")
    text = str(info.value)
    assert "mixer.norm" in text and "declaration of gated_rms_norm failed" in text
    assert "group_size_attr: group_size fits" in text  # the declaration 5.23 needs
    assert not engine.is_patched(model)
    assert_same(before, snapshot(model))


# ---------------------------------------------------------------------------------------------
# The cache cannot be fooled


def test_an_edited_patchset_is_a_new_entry(tmp_path: Path, cache: Path) -> None:
    model = _tiny_qwen3()
    _apply(model, _written(tmp_path, _qwen3()))
    engine.revert(model)
    report, _ = _apply(model, _written(tmp_path, _qwen3(description="edited")))
    assert not report.release.cached and len(_entries(cache)) == 2


def test_another_torch_another_device_kind_another_dtype_is_another_key() -> None:
    patchset = load_patchset(_qwen3())
    base: dict[str, Any] = {"device_kind": "cpu", "dtype": "fp32", "mode": "training", "kernels": {"0": ["torch"]}}
    material = key_material(patchset, **base)
    assert material["libraries"]["torch"] == torch.__version__ and material["libraries"]["transformers"] == INSTALLED
    other_torch = key_material(patchset, **base, versions={**dict(library_versions()), "torch": "2.15.0"})
    keys = {key_of(material), key_of(other_torch)}
    for change in ({"device_kind": "cuda NVIDIA H200 (sm_90)"}, {"device_kind": device_kind("cuda", interpreted=True)},
                   {"dtype": "bf16"}, {"mode": "inference"}, {"kernels": {"0": ["liger"]}}):
        keys.add(key_of(key_material(patchset, **{**base, **change})))
    assert len(keys) == 7


def test_an_entry_from_another_torch_under_this_name_is_not_read(tmp_path: Path, cache: Path) -> None:
    model = _tiny_qwen3()
    _apply(model, _written(tmp_path, _qwen3()))
    engine.revert(model)
    (entry,) = _entries(cache)
    data = json.loads(entry.read_text())
    data["material"]["libraries"]["torch"] = "2.15.0"  # what another torch's apply would have written
    entry.write_text(json.dumps(data))
    with pytest.warns(engine.VerdictCacheWarning, match="made for other versions"):
        report, _ = _apply(model, _written(tmp_path, _qwen3()))
    assert not report.release.cached and report.release.passed
    assert json.loads(entry.read_text())["material"]["libraries"]["torch"] == torch.__version__  # overwritten


@pytest.mark.parametrize("damage", ["not json", "truncated", "failure turned into a pass", "other format"])
def test_a_corrupt_entry_is_a_warning_and_a_fresh_verification_never_a_stale_pass(
        tmp_path: Path, cache: Path, damage: str) -> None:
    data = _qwen3()
    data["patches"][0]["scale"] = "one_plus_weight"
    model = _tiny_qwen3()
    with pytest.raises(engine.ReleaseVerificationFailed):
        engine.apply(model, data, device="cpu")
    (entry,) = _entries(cache)
    text = entry.read_text()
    stored = json.loads(text)
    if damage == "not json":
        entry.write_text("\x00garbage")
    elif damage == "truncated":
        entry.write_text(text[: len(text) // 2])
    elif damage == "failure turned into a pass":
        stored["passed"], stored["verdict"]["passed"], stored["finding"] = True, True, ""
        entry.write_text(json.dumps(stored))
    else:
        stored["format"] = 999
        entry.write_text(json.dumps(stored))
    with pytest.warns(engine.VerdictCacheWarning, match="ignored the cached verdict"), \
            pytest.raises(engine.ReleaseVerificationFailed) as info:
        engine.apply(model, data, device="cpu")
    assert not info.value.verdict.cached  # verified again, and refused again
    assert not engine.is_patched(model)
    assert json.loads(entry.read_text())["passed"] is False  # overwritten with the fresh verdict


def test_an_unwritable_cache_folder_is_a_warning_and_the_verification_still_decides(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("PATCH_ENGINE_CACHE_DIR", str(blocker / "cache"))  # cannot be created, even as root
    model = _tiny_qwen3()
    for _ in range(2):  # nothing kept: each apply verifies
        with pytest.warns(engine.VerdictCacheWarning, match="cannot write the verdict"):
            report, said = _apply(model, _written(tmp_path, _qwen3()))
        assert report.release.passed and not report.release.cached and report.release.cache_file is None
        assert "not cached" in said[0]
        engine.revert(model)


def test_xdg_cache_home_is_respected_and_our_variable_overrides_it(tmp_path: Path, monkeypatch) -> None:
    from engine.releases import cache_dir

    monkeypatch.delenv("PATCH_ENGINE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "patch-engine"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_dir() == Path.home() / ".cache" / "patch-engine"
    monkeypatch.setenv("PATCH_ENGINE_CACHE_DIR", str(tmp_path / "own"))
    assert cache_dir() == tmp_path / "own"


_RANK = '''
import json, os, sys, warnings
import torch.distributed as dist
import engine
from engine.loader import load_patchset
from engine.tiny import build_tiny_model
dist.init_process_group("gloo")
model = build_tiny_model("qwen3", dict(load_patchset("qwen3").tiny_model.config))
dist.barrier()  # every rank reaches the empty cache at once
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    report = engine.apply(model, sys.argv[1], device="cpu")
v = report.release
with open(f"{sys.argv[2]}/rank{dist.get_rank()}.json", "w") as out:  # a file per rank: stdout lines interleave
    json.dump({"rank": dist.get_rank(), "passed": v.passed, "cached": v.cached, "file": v.cache_file}, out)
dist.destroy_process_group()
'''


def test_ranks_of_one_torchrun_leave_one_valid_entry_and_reach_the_same_verdict(tmp_path: Path, cache: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(_RANK, encoding="utf-8")
    patchset = _written(tmp_path, _qwen3())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3", "--master_port",
                           "29541", str(script), str(patchset), str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
    assert sorted(r["rank"] for r in results) == [0, 1, 2]
    assert all(r["passed"] for r in results) and len({r["file"] for r in results}) == 1
    assert sum(not r["cached"] for r in results) == 1  # one rank verified; the others waited and read its verdict
    (entry,) = _entries(cache)
    assert json.loads(entry.read_text())["passed"] is True
    assert not list((cache / "release-verdicts").glob("*.tmp"))


# ---------------------------------------------------------------------------------------------
# The policy: one setting, the same everywhere


def test_refuse_is_the_old_refusal_and_trust_patches_with_a_warning(tmp_path: Path, cache: Path) -> None:
    model = _tiny_qwen3()
    before = snapshot(model)
    with pytest.raises(engine.VersionMismatch) as info:
        engine.apply(model, _qwen3(), device="cpu", unverified_release="refuse")
    assert f"requires transformers{BELOW}; installed is {INSTALLED}" in str(info.value)
    assert "unverified='verify'" in str(info.value)  # says how to let it verify instead
    assert "engine.verify(model, patchset)" in str(info.value)  # a dict: no `patch-engine verify qwen3` (the bundled one)
    assert_same(before, snapshot(model))
    report, said = _apply(model, _qwen3(), unverified_release="trust")
    assert engine.is_patched(model) and "patched without verifying it there" in said[0]
    assert report.release.policy == "trust" and not (cache / "release-verdicts").exists()


def test_the_environment_variable_sets_the_default_and_the_keyword_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _tiny_qwen3()
    monkeypatch.setenv("PATCH_ENGINE_UNVERIFIED_RELEASE", "refuse")
    with pytest.raises(engine.VersionMismatch):
        engine.apply(model, _qwen3(), device="cpu")
    _, said = _apply(model, _qwen3(), unverified_release="trust")
    assert engine.is_patched(model) and said
    engine.revert(model)
    monkeypatch.setenv("PATCH_ENGINE_UNVERIFIED_RELEASE", "bogus")
    before = snapshot(model)
    with pytest.raises(engine.InvalidArgument, match=r"\$PATCH_ENGINE_UNVERIFIED_RELEASE='bogus'.*verify.*refuse.*trust"):
        engine.apply(model, "qwen3", device="cpu")  # a bad value is an error even inside the range
    assert_same(before, snapshot(model))
    with pytest.raises(engine.InvalidArgument, match="unverified_release='never'"):
        engine.apply(model, "qwen3", device="cpu", unverified_release="never")


def test_plan_says_what_apply_will_do_and_changes_nothing(tmp_path: Path, cache: Path) -> None:
    model = _tiny_qwen3()
    the_plan = engine.plan(model, _qwen3(), device="cpu")
    assert the_plan.release is not None and the_plan.release.installed == INSTALLED
    assert "apply verifies the patchset on it first" in str(the_plan)
    assert not engine.is_patched(model) and not cache.exists()
    assert engine.plan(model, "qwen3", device="cpu").release is None  # inside the range: nothing to say


def test_apply_with_verify_lets_the_models_own_verification_stand_for_the_release(tmp_path: Path, cache: Path) -> None:
    model = _tiny_qwen3()
    report, said = _apply(model, _qwen3(), verify=True)
    assert report.verification.passed and "this model's own verification" in said[0] and "passed" in said[0]
    assert not cache.exists()  # no tiny model was built, nothing cached
    engine.revert(model)
    data = _qwen3()
    data["patches"][0]["scale"] = "one_plus_weight"
    with pytest.raises(engine.VerificationFailed) as info:
        engine.apply(model, data, device="cpu", verify=True)
    assert f"transformers {INSTALLED} is outside" in str(info.value) and not engine.is_patched(model)


def test_cli_flag_and_plan_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _written(tmp_path, _qwen3())
    assert main(["plan", str(path)]) == EXIT_OK
    assert "apply verifies the patchset on it first" in capsys.readouterr().out
    assert main(["plan", str(path), "--unverified-release", "refuse"]) == EXIT_FAILED
    assert f"requires transformers{BELOW}" in capsys.readouterr().err
    assert main(["verify", str(path)]) == EXIT_OK  # the verification is on this release: said so, no gate
    out = capsys.readouterr().out
    assert "this verification is on the installed release" in out and "verification passed" in out
    assert main(["plan", str(path), "--unverified-release", "bogus"]) == EXIT_USAGE
    assert os.environ.get("PATCH_ENGINE_UNVERIFIED_RELEASE") is None  # the flag does not outlive the command


def test_demo_works_on_a_release_outside_the_range(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _written(tmp_path, _qwen3(), "qwen3.yaml")
    with pytest.warns(engine.UnverifiedReleaseWarning, match=f"transformers {INSTALLED} is outside") as caught:
        code = main(["demo", "--patchset", str(path), "--steps", "1"])
    out = capsys.readouterr().out
    assert code == EXIT_OK and "numbers match" in out and "verification passed" in out
    assert any("this model's own verification" in str(w.message) for w in caught)  # the demo verifies its model
    assert f"transformers {INSTALLED} is outside" in out  # and the report says so


def test_trainer_callback_takes_the_setting(tmp_path: Path) -> None:
    from engine.integrations.transformers import PatchsetCallback

    with pytest.raises(engine.InvalidArgument, match=r"PatchsetCallback\(unverified_release=...\)='sometimes'"):
        PatchsetCallback("qwen3", unverified_release="sometimes")
    callback = PatchsetCallback(_qwen3(), unverified_release="refuse")
    model = _tiny_qwen3()
    with pytest.raises(engine.VersionMismatch):
        callback.on_init_end(None, None, None, model=model)
    assert not engine.is_patched(model)


def test_self_verification_compiles_only_what_this_model_would_run(tmp_path: Path, monkeypatch) -> None:
    """An fp32 training model never runs the compiled code (engine/_data/compiled_rows.yaml): verifying it on an
    unverified release must not compile the bf16 inference code verification would otherwise force (seconds each)."""
    from engine.kernels import compiled

    if compiled.find_cxx() is None:
        pytest.skip("no C++ compiler: compiled kernels are passed over anyway")
    monkeypatch.setenv(compiled.ENV_SWITCH, "1")
    compiled.clear_cache()
    model = _tiny_qwen3()
    report, _ = _apply(model, _written(tmp_path, _qwen3()))
    assert report.release.passed and {d.kernel for d in report.decisions if d.op == "rms_norm"} == {"compiled"}
    assert not [key for key, kernel in compiled.kernels().items() if kernel.functions]  # nothing compiled
