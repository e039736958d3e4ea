"""The verified-content manifest is up to date: a bundled file edited without regenerating it fails here.

``engine/_data/verified_content.json`` says which bundled *content* the compatibility matrix
verified on which release; ``engine.apply`` patches with it without verifying it first. A bundled
file whose content is not in it would be verified at every user's first apply (safe, but not what
CI claims); one whose old content lingers there would claim a verification of content no file
has. Both fail here with the command that regenerates the manifest. Torch-free and fast.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engine.commands.matrix import MANIFEST
from engine.releases.manifest import FILE, column_text, current_content, installed_column, load_manifest, merged

ROOT = Path(__file__).resolve().parent.parent
LOCK = re.search(r"^transformers==(\S+)$", (ROOT / ".ci" / "constraints.txt").read_text(), re.M).group(1)


def _regenerate(names: list[str]) -> str:
    return (f"regenerate it under the suite's release: python -m engine.commands.matrix run {' '.join(names)} "
            "--out /tmp/m.json && python -m engine.commands.matrix manifest /tmp/m.json (bash .ci/matrix "
            "regenerates every release's column)")


def test_every_bundled_content_is_in_the_manifest_and_nothing_else_is() -> None:
    manifest = json.loads(MANIFEST.read_text(encoding="utf-8"))
    current = current_content()
    missing = sorted(name for name, sha in current.items() if sha not in manifest["content"])
    assert not missing, (f"bundled patchsets whose content is not in {MANIFEST.name} (edited, or added, without "
                         f"regenerating it): {', '.join(missing)}; " + _regenerate(missing))
    stale = sorted(e["patchset"] for sha, e in manifest["content"].items() if sha not in current.values())
    assert not stale, f"{MANIFEST.name} holds content no bundled file has any more ({', '.join(stale)}); " + \
        _regenerate(stale)


def test_the_suites_release_is_a_column_of_every_bundled_content() -> None:
    """Under the lock's transformers (the suite's), every bundled patchset is known verified: no self-verification."""
    here = installed_column()
    if here[0] != LOCK:
        pytest.skip(f"transformers {here[0]} is not the lock's {LOCK} (a matrix column of its own)")
    manifest = load_manifest()
    lacking = sorted(name for name, sha in current_content().items()
                     if here not in [(c["transformers"], c.get("kernels"))
                                     for c in manifest["content"].get(sha, {}).get("verified_on", [])])
    assert not lacking, (f"not verified on {column_text(here)} per the manifest: {', '.join(lacking)}; "
                         + _regenerate(lacking))


def test_the_package_reads_the_manifest_from_its_own_data_folder() -> None:
    """Shipped in the wheel: it lies in engine/_data (packages = ["engine"]), read with importlib.resources."""
    assert MANIFEST == ROOT / "engine" / "_data" / FILE and MANIFEST.is_file()
    assert 'packages = ["engine"]' in (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    assert load_manifest()["content"] == json.loads(MANIFEST.read_text(encoding="utf-8"))["content"]


def test_a_rerun_that_fails_withdraws_the_claim_and_edited_content_is_dropped() -> None:
    current = {"a": "1" * 64, "b": "2" * 64}
    old = {"content": {"1" * 64: {"patchset": "a", "verified_on": [{"transformers": "5.0.0", "kernels": None}]},
                       "9" * 64: {"patchset": "b", "verified_on": [{"transformers": "5.0.0", "kernels": None}]}}}
    result = {"transformers": "5.0.0", "kernels": None, "label": None,
              "cells": [{"patchset": "a", "status": "fails", "sha256": "1" * 64},
                        {"patchset": "b", "status": "verified", "sha256": "2" * 64}]}
    newest = {**result, "label": "newest", "transformers": "5.99.0"}  # not a pinned release: no claim
    new = merged(old, [result, newest], current)
    assert new["content"] == {"2" * 64: {"patchset": "b", "verified_on": [{"transformers": "5.0.0", "kernels": None}]}}
