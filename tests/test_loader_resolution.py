"""Which file a name means, and which files are never read (issue 11, scenarios 2 and 7).

Scenario 2: ``engine.apply(m, "qwen3.yaml")`` and ``patch-engine validate qwen3.yaml`` must use
``./qwen3.yaml`` (the copy the user is editing) when it exists; a bare ``qwen3`` is the bundled
one; the Report, the plan and every CLI line name the file actually used.

Scenario 7: ``extends`` (and the top-level file) takes only bundled names and ``.yaml``/``.yml``
files; anything else is refused without being read, and nothing of its content is echoed.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_for

import engine
from engine.commands.cli import main
from engine.errors import PatchsetError
from engine.loader import bundled_dir, load_patchset, resolve
from engine.verification import probe_batch

BUNDLED_QWEN3 = bundled_dir() / "qwen3.yaml"

#: A line no patchset has: if it shows up in an error or output, a non-patchset file was echoed.
SECRET = "root:x:0:0:TOPSECRET-4711:/root:/bin/bash"


def _local_copy(folder: Path, *, change: tuple[str, str], name: str = "qwen3.yaml") -> Path:
    """A copy of the bundled qwen3 patchset, as a user edits it, with one declaration changed."""
    text = BUNDLED_QWEN3.read_text(encoding="utf-8")
    assert change[0] in text
    path = folder / name
    path.write_text(text.replace(change[0], change[1], 1), encoding="utf-8")
    return path


def _logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch["input_ids"]).logits


# --------------------------------------------------------------------------------------
# Scenario 2: an existing path wins; a bare name is bundled; the file used is named


def test_apply_uses_the_local_copy_and_a_bare_name_the_bundled_one(tmp_path, monkeypatch):
    """The local copy declares ``one_plus_weight`` (wrong for qwen3, on purpose): applying it must
    change the numbers, while the bundled patchset, asked for by bare name, leaves them exact."""
    local = _local_copy(tmp_path, change=("scale: weight", "scale: one_plus_weight"))
    monkeypatch.chdir(tmp_path)
    model = tiny_for("qwen3")
    batch = probe_batch(model)
    expected = _logits(model, batch)

    # the wrong copy is the marker of which file ran: applied unverified on purpose (by default it is refused,
    # tests/test_trust_by_default.py)
    report = engine.apply(model, "qwen3.yaml", device="cpu", unverified="trust")
    assert report.file == str(local) and report.files == (str(local),)
    assert str(local) in str(report) and report.to_dict()["file"] == str(local)
    local_logits = _logits(model, batch)
    assert (local_logits - expected).abs().max() > 1e-3  # the edited declaration is what ran
    engine.revert(model)

    report = engine.apply(model, "qwen3", device="cpu")
    assert report.file == str(BUNDLED_QWEN3)
    assert torch.equal(_logits(model, batch), expected)  # the bundled file, exact
    engine.revert(model)

    report = engine.apply(model, "./qwen3.yaml", device="cpu", unverified="trust")
    assert report.file == str(local)
    assert torch.equal(_logits(model, batch), local_logits)
    engine.revert(model)

    the_plan = engine.plan(model, "qwen3.yaml", device="cpu")
    assert the_plan.file == str(local) and f"from {local}" in str(the_plan)
    assert torch.equal(_logits(model, batch), expected)  # planning changed nothing


def test_cli_lines_name_the_file_actually_used(tmp_path, monkeypatch, capsys):
    """validate, plan and verify (text and --json) on ``qwen3.yaml`` read the local copy, which
    drops the MLP patch, and say so with its full path."""
    local = _local_copy(tmp_path, change=("  - target: Qwen3MLP\n    op: swiglu\n", ""))
    monkeypatch.chdir(tmp_path)

    assert main(["validate", "qwen3.yaml", "qwen3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{local}: ok (qwen3, 2 patches)", f"{BUNDLED_QWEN3}: ok (qwen3, 3 patches)"]

    assert main(["validate", "--json", "qwen3.yaml"]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["files"]
    assert entry["file"] == str(local) and entry["given"] == "qwen3.yaml" and entry["patches"] == 2

    assert main(["plan", "qwen3.yaml", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith(f"plan 'qwen3' from {local} for a tiny qwen3")
    assert "Qwen3RMSNorm" in out and "Qwen3MLP" not in out

    assert main(["plan", "qwen3.yaml", "--device", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["file"] == str(local)
    assert {d["class"] for d in data["decisions"]} == {"Qwen3RMSNorm", "function"}

    assert main(["verify", "qwen3.yaml", "--device", "cpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is True and data["file"] == str(local)

    assert main(["verify", "qwen3", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith(f"verify 'qwen3' from {BUNDLED_QWEN3} on a tiny")


def test_name_rules(tmp_path, monkeypatch):
    """Bare names are bundled first; file names and paths are files first; a missing plain file
    name falls back to the bundled patchset of its stem (what Liger/LlamaFactory users type)."""
    monkeypatch.chdir(tmp_path)
    assert resolve("qwen3.yaml") == BUNDLED_QWEN3  # no local copy: bundled fallback
    local = _local_copy(tmp_path, change=("name: qwen3", "name: mine"))
    assert resolve("qwen3.yaml") == local
    assert resolve("qwen3") == BUNDLED_QWEN3
    assert resolve(Path("qwen3.yaml")) == local
    assert resolve(str(local)) == local
    mine = _local_copy(tmp_path, change=("name: qwen3", "name: mine"), name="mine.yml")
    assert resolve("mine") == mine  # not bundled: the local file of that name
    assert load_patchset("mine").files == (str(mine),)
    (tmp_path / "sub").mkdir()
    with pytest.raises(PatchsetError, match=r"no patchset 'sub/qwen3\.yaml': no such file"):
        resolve("sub/qwen3.yaml")  # an explicit folder never falls back to the bundled file


def test_extends_bare_name_is_bundled_and_paths_are_relative_to_the_extending_file(tmp_path, monkeypatch):
    configs = tmp_path / "configs"
    (configs / "base").mkdir(parents=True)
    edited = _local_copy(configs, change=("scale: weight", "scale: one_plus_weight"))
    base = _local_copy(configs / "base", change=("name: qwen3", "name: base"), name="b.yaml")
    (configs / "by_name.yaml").write_text("name: by_name\nextends: qwen3\n", encoding="utf-8")
    (configs / "by_file.yaml").write_text("name: by_file\nextends: qwen3.yaml\n", encoding="utf-8")
    (configs / "by_path.yaml").write_text("name: by_path\nextends: ./base/b.yaml\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)  # not the folder of the files: paths must not depend on it

    by_name = load_patchset("configs/by_name.yaml")
    assert by_name.files == (str(configs / "by_name.yaml"), str(BUNDLED_QWEN3))
    assert by_name.patches[0].scale == "weight"
    by_file = load_patchset("configs/by_file.yaml")
    assert by_file.files[1] == str(edited) and by_file.patches[0].scale == "one_plus_weight"
    by_path = load_patchset(configs / "by_path.yaml")
    assert by_path.files[1] == str(base)

    model = tiny_for("qwen3")
    report = engine.apply(model, "configs/by_file.yaml", device="cpu", unverified="trust")  # extends the wrong copy
    assert report.files == (str(configs / "by_file.yaml"), str(edited))
    assert f"(extends {edited})" in str(report)
    engine.revert(model)


# --------------------------------------------------------------------------------------
# Scenario 7: only bundled names and .yaml/.yml files are read; nothing else is echoed


def _secret_file(folder: Path, name: str = "secret.txt") -> Path:
    path = folder / name
    path.write_text(SECRET + "\n" + SECRET + "\n", encoding="utf-8")
    return path


def test_extends_refuses_files_that_are_not_yaml_without_reading_them(tmp_path):
    (tmp_path / "etc").mkdir()
    _secret_file(tmp_path / "etc", "passwd")
    configs = tmp_path / "a" / "b"
    configs.mkdir(parents=True)
    child = configs / "child.yaml"
    child.write_text("name: x\nmodel_types: [qwen3]\nextends: ../../etc/passwd\n", encoding="utf-8")
    with pytest.raises(PatchsetError) as info:
        load_patchset(child)
    err = info.value
    assert (err.file, err.line, err.key) == (str(child), 3, "extends")
    assert str(err).startswith(f"{child}:3: extends: '../../etc/passwd' is not a .yaml/.yml file")
    assert "bundled name" in err.problem and "qwen3" in err.problem  # how to fix
    assert "TOPSECRET" not in str(err) and "root:" not in str(err)

    system = Path("/etc/passwd")
    if system.is_file():
        child.write_text(f"name: x\nmodel_types: [qwen3]\nextends: {'../' * 12}etc/passwd\n", encoding="utf-8")
        message = str(pytest.raises(PatchsetError, load_patchset, child).value)
        assert "is not a .yaml/.yml file" in message and "root:" not in message


def test_a_yaml_symlink_to_another_file_is_not_read(tmp_path):
    secret = _secret_file(tmp_path)
    link = tmp_path / "innocent.yaml"
    try:
        link.symlink_to(secret)
    except OSError:
        pytest.skip("no symlinks here")
    child = tmp_path / "child.yaml"
    child.write_text("name: x\nmodel_types: [qwen3]\nextends: innocent.yaml\n", encoding="utf-8")
    for source in (child, link):
        with pytest.raises(PatchsetError, match="is not a .yaml/.yml file") as info:
            load_patchset(source)
        assert "TOPSECRET" not in str(info.value)


def test_top_level_file_that_is_not_yaml_is_refused_unread(tmp_path, capsys):
    secret = _secret_file(tmp_path)
    for source in (secret, str(secret), tmp_path):  # a path, a string, a folder
        with pytest.raises(PatchsetError, match=r"not read as a patchset; give a bundled name or a \.yaml") as info:
            load_patchset(source)
        assert info.value.file == str(Path(source).absolute())
        assert "TOPSECRET" not in str(info.value)
    assert main(["validate", str(secret)]) == 1
    assert main(["validate", "--json", str(secret)]) == 1
    captured = capsys.readouterr()
    assert "TOPSECRET" not in captured.out + captured.err
    assert "is not a .yaml/.yml file" in captured.err


def test_yaml_file_holding_something_else_shows_no_content(tmp_path):
    """A .yaml file that is a single scalar (a copied password line) says what kind, not what."""
    copied = _secret_file(tmp_path, "copied.yaml")
    child = tmp_path / "child.yaml"
    child.write_text("name: x\nmodel_types: [qwen3]\nextends: copied.yaml\n", encoding="utf-8")
    for source in (copied, child):
        with pytest.raises(PatchsetError) as info:
            load_patchset(source)
        assert info.value.file == str(copied) and info.value.line == 1
        assert "the top level must be a mapping" in str(info.value) and "not a string" in str(info.value)
        assert "TOPSECRET" not in str(info.value)
