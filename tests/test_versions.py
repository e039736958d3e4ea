"""Patches per transformers release (`when`), `requires` as the verified range, and the matrix's check.

Real tiny Qwen3 models, real planning and verification: the patch a `when` selects is the one
that runs (a wrong one selected makes verify fail), and a refusal leaves the model as it was.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import transformers
from packaging.version import Version
from snapshots import assert_same, snapshot

import engine
from engine.commands.matrix import check_claims, installed_kernels, render_section, run
from engine.tiny import build_tiny_model

INSTALLED = Version(transformers.__version__)
#: A range that holds the installed release, and one that does not.
NOW, NOT_NOW = f">={INSTALLED.major}.0", f"<{INSTALLED.major}.0"


def _two_norm_patches(tmp_path: Path, right: str, wrong: str) -> Path:
    """qwen3's norm declared twice: the true one (weight) for ``right``, a wrong one (1 + w) for ``wrong``."""
    path = tmp_path / "versioned.yaml"
    path.write_text(
        "name: versioned\nmodel_types: [qwen3]\npatches:\n"
        f"  - {{target: Qwen3RMSNorm, op: rms_norm, scale: weight, when: {{transformers: '{right}'}}}}\n"
        f"  - {{target: Qwen3RMSNorm, op: rms_norm, scale: one_plus_weight, when: {{transformers: '{wrong}'}}}}\n"
        "  - {target: Qwen3MLP, op: swiglu}\n",
        encoding="utf-8",
    )
    return path


def test_when_selects_the_patch_for_the_installed_release(tmp_path: Path) -> None:
    model = build_tiny_model("qwen3", {})
    plan = engine.plan(model, _two_norm_patches(tmp_path, right=NOW, wrong=NOT_NOW), device="cpu")
    norms = [d for d in plan.decisions if d.cls == "Qwen3RMSNorm"]
    assert {d.patch.scale.value for d in norms if d.action == "patch"} == {"weight"}
    (left_out,) = [d for d in norms if d.action == "skip"]
    assert left_out.patch_index == 1 and left_out.reason == f"for transformers{NOT_NOW} (installed: {INSTALLED})"
    engine.apply(model, plan.patchset, device="cpu")
    assert engine.verify(model, raise_on_failure=False).passed


def test_the_patch_when_selects_is_the_one_that_runs(tmp_path: Path) -> None:
    # the same file with the ranges swapped: the (1 + w) declaration is now the installed release's,
    # and verification sees its numbers (so `when` is not a comment: it decides what runs)
    model = build_tiny_model("qwen3", {})
    # wrong on purpose (by default apply refuses it): the verifier's own report is what this test reads
    engine.apply(model, _two_norm_patches(tmp_path, right=NOT_NOW, wrong=NOW), device="cpu", unverified="trust")
    report = engine.verify(model, raise_on_failure=False)
    assert not report.passed and {c.cls for c in report.failures} >= {"Qwen3RMSNorm"}


def test_overlapping_when_ranges_are_refused_before_anything_changes(tmp_path: Path) -> None:
    model = build_tiny_model("qwen3", {})
    before = snapshot(model)
    path = _two_norm_patches(tmp_path, right=NOW, wrong=f">={INSTALLED.major}.0,<{INSTALLED.major + 1}")
    with pytest.raises(engine.PatchsetError, match=r"versioned\.yaml:5: patches\[0\] and patches\[1\] both target "
                       r"Qwen3RMSNorm on transformers .*make their `when` ranges disjoint"):
        engine.apply(model, path, device="cpu")
    assert_same(before, snapshot(model))
    assert not engine.is_patched(model)


def test_a_when_that_is_not_a_version_range_is_a_load_error(tmp_path: Path) -> None:
    path = _two_norm_patches(tmp_path, right="<<5", wrong=NOT_NOW)
    with pytest.raises(engine.PatchsetError, match=r"versioned\.yaml:4: patches\[0\]\.when\.transformers: '<<5' is not "
                       r"a PEP 440 version range"):
        engine.load_patchset(path)


def test_requires_outside_the_installed_release_refuses_with_the_verified_range_when_told_to(tmp_path: Path) -> None:
    path = tmp_path / "old.yaml"
    path.write_text(f"name: old\nmodel_types: [qwen3]\nrequires: {{transformers: '{NOT_NOW}'}}\npatches:\n"
                    "  - {target: Qwen3MLP, op: swiglu}\n", encoding="utf-8")
    model = build_tiny_model("qwen3", {})
    before = snapshot(model)
    with pytest.raises(engine.VersionMismatch) as info:  # the default verifies on this release: test_release_self_verify
        engine.apply(model, path, device="cpu", unverified_release="refuse")
    message = str(info.value)
    assert f"requires transformers{NOT_NOW}; installed is {INSTALLED}" in message
    assert "versions it is verified on" in message and "nothing was patched" in message
    assert_same(before, snapshot(model))
    assert not engine.is_patched(model)


def test_every_bundled_patchset_claims_the_installed_release() -> None:
    # the suite's release is in the matrix; a patchset claiming less would not be verified by the suite
    from engine.foundation.versions import in_range
    from engine.loader import bundled_names, load_patchset

    outside = [n for n in bundled_names() if not in_range(load_patchset(n).requires.transformers, str(INSTALLED))]
    assert outside == []


def test_matrix_rows_say_verified_refused_absent_and_the_sweep_goes_on(tmp_path: Path) -> None:
    refused = tmp_path / "renamed.yaml"
    refused.write_text("name: renamed\nmodel_types: [qwen3]\npatches:\n  - {target: Qwen3Experts, op: moe_experts}\n",
                       encoding="utf-8")
    absent = tmp_path / "future.yaml"
    absent.write_text("name: future\nmodel_types: [qwen9]\npatches:\n  - {target: Qwen9MLP, op: swiglu}\n",
                      encoding="utf-8")
    result = run([str(refused), str(absent), "qwen3"])
    cells = {Path(c["patchset"]).stem: c for c in result["cells"]}
    assert result["transformers"] == str(INSTALLED)
    assert cells["renamed"]["status"] == "refused" and "TargetNotFound" in cells["renamed"]["reason"]
    assert cells["future"]["status"] == "absent" and "qwen9" in cells["future"]["reason"]
    assert cells["qwen3"]["status"] == "verified"


def test_matrix_check_fails_a_range_that_claims_a_release_where_the_patchset_is_refused() -> None:
    results = [
        {"transformers": "5.6.0", "cells": [{"patchset": "a", "status": "refused", "reason": "TargetNotFound: X"},
                                            {"patchset": "b", "status": "verified", "reason": ""}]},
        {"transformers": "5.24.0", "cells": [{"patchset": "a", "status": "verified", "reason": ""},
                                             {"patchset": "b", "status": "verified", "reason": ""}]},
    ]
    claims = {"a": ">=5.0,<5.25", "b": ">=5.10,<5.25"}
    (problem,) = check_claims(results, claims)
    assert problem.startswith("a: requires transformers>=5.0,<5.25, which holds 5.6.0, but there it is refused")
    assert check_claims(results, {"a": ">=5.10,<5.25", "b": ">=5.10,<5.25"}) == []
    text = render_section(results, claims)
    assert "| a | `>=5.0,<5.25` | refused [1] | yes |" in text and "1. a on 5.6.0: TargetNotFound: X" in text
    assert "| b | `>=5.10,<5.25` | yes (not claimed) | yes |" in text
    assert "| verified | 1 | 2 |" in text and "| refused | 1 | 0 |" in text


def test_matrix_has_a_column_per_release_with_kernels_installed_held_to_the_same_range() -> None:
    plain = {"transformers": "5.20.1", "cells": [{"patchset": "a", "status": "verified", "reason": ""}]}
    with_kernels = {"transformers": "5.20.1", "kernels": "0.17.2",
                    "cells": [{"patchset": "a", "status": "refused", "reason": "SignatureMismatch: rope"}]}
    text = render_section([with_kernels, plain], {"a": ">=5.0,<5.25"})
    assert "| patchset | requires | 5.20.1 | 5.20.1 + kernels 0.17.2 |" in text  # sorted: plain first
    assert "| a | `>=5.0,<5.25` | yes | refused [1] |" in text
    assert "1. a on 5.20.1 + kernels 0.17.2: SignatureMismatch: rope" in text
    (problem,) = check_claims([plain, with_kernels], {"a": ">=5.0,<5.25"})
    assert "which holds 5.20.1 + kernels 0.17.2, but there it is refused" in problem
    assert run(["qwen3"])["kernels"] == installed_kernels()  # None here unless HF kernels is installed
