"""The verified-content manifest: which bundled patchset content CI verified on which transformers release.

Why content and not a name or a range: what patches without a self-verification must be known
verified on the installed release, and what was verified is a *content* (``qwen3.yaml`` as it
was when the compatibility matrix ran it), not a file name (a user edits the installed copy,
copies it, or builds a dict from it) nor a range (the range a user types decides nothing). So
``.ci/matrix`` writes, for every bundled patchset it verified, the sha256 of its resolved content
(:func:`content_sha256`) and the release it verified it on; the package ships the file
(``engine/_data/verified_content.json``), and ``tests/test_trust_manifest.py`` fails when a bundled
file no longer has the content the manifest names, with the command that regenerates it.

A release is a column of the matrix: the transformers version, and the version of Hugging Face's
``kernels`` package where transformers uses it (it wraps functions then: another code path).
Content verified on 5.20.1 with ``kernels`` 0.17.2 is not thereby verified on 5.20.1 without it.

Imports neither torch nor transformers at import time (``installed_kernels`` asks transformers
when called): ``engine.plan`` and ``patch-engine plan`` read it too.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterable, Mapping
from importlib import resources
from typing import Any

__all__ = ["FILE", "FORMAT", "Column", "column_text", "content_sha256", "current_content",
           "installed_column", "installed_kernels", "load_manifest",
           "merged", "verified_code", "verified_columns"]

#: The manifest, in the package's data folder (shipped in the wheel with the rest of ``engine/``).
FILE = "verified_content.json"
FORMAT = 1
#: A matrix column: ``(transformers version, kernels version or None)``.
Column = tuple[str, str | None]

_ABOUT = ("Bundled patchset content the compatibility matrix verified, per release: the sha256 of each "
          "patchset's resolved content (engine.releases.manifest.content_sha256) -> the columns "
          "(transformers, kernels) it verified on. Written by .ci/matrix (python -m engine.commands.matrix "
          "render ... --manifest, or manifest RESULTS.json for one release); checked by "
          "tests/test_trust_manifest.py. Do not edit by hand.")


def content_sha256(patchset: Any) -> str:
    """The sha256 of a patchset's resolved content (``extends`` merged in), the fused head left out.

    Why these choices: the content is the loaded model (every ``extends`` base merged, no file
    names or paths), written with its defaults left out, so a new schema field with a default
    does not change what a bundled file's content is; the fused head (``fused_cross_entropy``) is
    a switch of the engine that any patchset takes (:mod:`engine.planning.fused_head`), not content.
    """
    from engine.planning.fused_head import without_fused_head

    data = without_fused_head(patchset).model_dump(mode="json", exclude_defaults=True)
    data.pop("fused_cross_entropy", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def load_manifest() -> dict[str, Any]:
    """The shipped manifest (``{"content": {sha: {"patchset", "verified_on": [...]}}}``); empty if absent."""
    try:
        text = resources.files("engine").joinpath("_data", FILE).read_text(encoding="utf-8")
    except FileNotFoundError:
        return {"format": FORMAT, "content": {}}
    data = json.loads(text)
    return data if data.get("format") == FORMAT else {"format": FORMAT, "content": {}}


def verified_columns(sha: str, manifest: Mapping[str, Any] | None = None) -> tuple[str | None, list[Column]]:
    """``(bundled name, columns)`` CI verified the content ``sha`` on; ``(None, [])`` for content it never ran."""
    entry = (manifest if manifest is not None else load_manifest()).get("content", {}).get(sha)
    if not entry:
        return None, []
    return entry.get("patchset"), [(c["transformers"], c.get("kernels")) for c in entry.get("verified_on", [])]


def verified_code(sha: str, column: Column, manifest: Mapping[str, Any] | None = None) -> dict[str, str] | None:
    """The code identities CI verified content ``sha`` on in ``column`` (``{"class Qwen3RMSNorm": id}``); ``None``
    where it recorded none (a manifest written before identities were recorded, or content it never verified)."""
    entry = (manifest if manifest is not None else load_manifest()).get("content", {}).get(sha) or {}
    for c in entry.get("verified_on", []):
        if (c["transformers"], c.get("kernels")) == column:
            code = c.get("code")
            return dict(code) if isinstance(code, dict) else None
    return None


@functools.lru_cache(maxsize=1)
def installed_kernels() -> str | None:
    """The version of HF's ``kernels`` package when transformers uses it (then it wraps functions in it).

    Installed is not enough: each release takes only the ``kernels`` versions it supports
    (``is_kernels_available``' bounds), and one outside them is as good as absent.
    """
    from importlib import metadata
    from importlib.util import find_spec

    if find_spec("kernels") is None:
        return None
    try:
        from transformers.utils.import_utils import is_kernels_available
    except ImportError:  # a release without the check: installed is used
        pass
    else:
        if not is_kernels_available():
            return None
    try:
        return metadata.version("kernels")
    except metadata.PackageNotFoundError:
        return None


def installed_column() -> Column:
    """The matrix column this process runs in: the installed transformers, and ``kernels`` where it is used."""
    from engine.foundation.versions import installed_version

    return installed_version() or "none", installed_kernels()


def column_text(column: Column) -> str:
    """``5.25.0 + kernels 0.19.1`` (as docs/compatibility.md heads its columns)."""
    return column[0] + (f" + kernels {column[1]}" if column[1] else "")


def merged(manifest: Mapping[str, Any], results: Iterable[Mapping[str, Any]], current: Mapping[str, str]) -> dict[str, Any]:
    """``manifest`` with the matrix ``results`` merged in, pruned to the bundled content of now.

    ``results``: the JSON of ``python -m engine.commands.matrix run`` (one per release; a labelled
    one, the newest releases of the day, is not a release CI pins and is left out). Each cell whose
    ``sha256`` is the current content of its patchset (``current``: name -> sha) adds its column
    where it verified, and removes it where it did not (a re-run that fails withdraws the claim).
    Content no bundled file has any more is dropped. A verified cell's ``code`` (the identity of each
    class and function it patched, :func:`engine.releases.code.patched_code`) is kept with its column:
    bundled content covers only that code.
    """
    content: dict[str, dict[str, Any]] = {sha: {"patchset": e["patchset"], "verified_on": list(e["verified_on"])}
                                          for sha, e in manifest.get("content", {}).items()}
    for result in results:
        if result.get("label"):
            continue
        column = {"transformers": result["transformers"], "kernels": result.get("kernels")}
        if result.get("code_only"):  # identities for columns already verified: adds code, never a column
            _add_code(content, column, result["cells"])
            continue
        for cell in result["cells"]:
            sha = cell.get("sha256")
            if not sha or current.get(cell["patchset"]) != sha:
                continue  # a result for content the file no longer has
            entry = content.setdefault(sha, {"patchset": cell["patchset"], "verified_on": []})
            entry["verified_on"] = [c for c in entry["verified_on"] if _column_of(c) != column]
            if cell["status"] == "verified":
                entry["verified_on"].append({**column, **({"code": cell["code"]} if cell.get("code") else {})})
    kept = set(current.values())
    out = {}
    for sha, entry in sorted(content.items(), key=lambda kv: kv[1]["patchset"]):
        if sha in kept and entry["verified_on"]:
            entry["verified_on"].sort(key=lambda c: (_version_key(c["transformers"]), c.get("kernels") or ""))
            out[sha] = entry
    return {"about": _ABOUT, "format": FORMAT, "content": out}


def _add_code(content: dict[str, dict[str, Any]], column: dict[str, Any], cells: Iterable[Mapping[str, Any]]) -> None:
    for cell in cells:
        for entry in content.get(cell.get("sha256") or "", {}).get("verified_on", []):
            if _column_of(entry) == column and cell.get("code"):
                entry["code"] = dict(cell["code"])


def _column_of(entry: Mapping[str, Any]) -> dict[str, Any]:
    return {"transformers": entry["transformers"], "kernels": entry.get("kernels")}


def _version_key(version: str) -> tuple[Any, ...]:
    from packaging.version import InvalidVersion, Version

    try:
        return (0, Version(version))
    except InvalidVersion:
        return (1, version)


def current_content() -> dict[str, str]:
    """Every bundled patchset's name -> the sha256 of its content now."""
    from engine.loader import bundled_names, load_patchset

    return {name: content_sha256(load_patchset(name)) for name in bundled_names()}
