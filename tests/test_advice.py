"""Advice that works: every command an error or a note of the command line suggests runs as printed,
and ``unverified`` is taken by every entry point that takes a patchset.

Why: a user told to pass ``device='cpu'`` to a shell command, or to write
``PatchsetCallback("qwen3", unverified="refuse")`` where the callback raised ``TypeError``, was
given advice that did not work. Here each suggestion is cut out of the message and run.
"""

from __future__ import annotations

import importlib.util
import io
import re
import shlex
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.commands.cli import main

ROOT = Path(__file__).resolve().parent.parent
NO_CUDA = not torch.cuda.is_available()


def suggested(message: str) -> list[list[str]]:
    """The ``patch-engine ...`` commands a message suggests, each as its argv (ending at ``;``, ``)`` or ``, then``)."""
    found = re.findall(r"patch-engine ((?:(?!, then )[^;)\n])+)", message)
    return [shlex.split(command.strip().rstrip(".")) for command in found]


def run(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue() + err.getvalue()


@pytest.mark.skipif(not NO_CUDA, reason="the error is for a machine without CUDA")
def test_a_missing_device_names_cli_flags_and_its_dry_run_runs_as_printed() -> None:
    code, text = run(["verify", "qwen3", "--device", "cuda"])
    assert code == 2
    assert "device=" not in text and "engine.plan(" not in text  # Python arguments: nowhere to type them
    assert "leave --device out (or give --device cpu)" in text
    commands = suggested(text)
    assert ["plan", "qwen3", "--device", "cuda"] in commands and ["verify", "qwen3", "--interpret"] in commands
    code, shown = run(["plan", "qwen3", "--device", "cuda"])
    assert code == 0 and "on cuda" in shown


@pytest.mark.skipif(not NO_CUDA, reason="the error is for a machine without CUDA")
def test_zero_configuration_on_a_missing_device_is_a_usage_error_with_its_dry_run() -> None:
    # before: it measured on 'cuda', patched nothing ("Torch not compiled with CUDA enabled") and exited 0
    code, text = run(["verify", "--model-type", "qwen3", "--device", "cuda"])
    assert code == 2 and suggested(text) == [["plan", "--model-type", "qwen3", "--device", "cuda"]]
    code, _ = run(suggested(text)[0])
    assert code == 0


@pytest.mark.slow
@pytest.mark.skipif(not NO_CUDA or importlib.util.find_spec("liger_kernel") is None,
                    reason="the interpreted CUDA plan runs liger's Triton kernels on a CPU")
def test_the_interpreted_plan_the_device_error_suggests_runs_as_printed() -> None:
    _, text = run(["verify", "qwen3", "--device", "cuda"])
    command = next(c for c in suggested(text) if "--interpret" in c)
    code, shown = run(command)
    assert code == 0 and "verification passed" in shown


def test_validates_note_suggests_plan_and_verify_that_run_as_printed() -> None:
    code, text = run(["validate", "qwen3"])
    assert code == 0
    commands = suggested(text)
    assert [c[0] for c in commands] == ["plan", "verify"] and all(c[1].endswith("qwen3.yaml") for c in commands)
    for command in commands:
        assert run(command)[0] == 0, command


def test_verify_with_no_patchset_on_a_folder_suggests_the_scaffold_then_verify(tmp_path: Path) -> None:
    from engine.commands.cli import _parser

    code, text = run(["verify", "--model", str(tmp_path)])
    assert code == 2
    scaffold, verify = suggested(text)
    assert scaffold == ["scaffold", "--model", str(tmp_path), "--out", "measured.yaml"]
    assert verify == ["verify", "measured.yaml", "--model", str(tmp_path)]
    for command in (scaffold, verify):  # both parse; running them needs a checkpoint (tests/test_scaffold*.py)
        _parser().parse_args(command)


def test_the_trainer_callback_takes_unverified() -> None:
    """The docs say one setting, ``unverified``, decides everywhere: the callback takes it (and its old name)."""
    from engine.errors import InvalidArgument
    from engine.integrations.transformers import PatchsetCallback

    assert PatchsetCallback("qwen3", unverified="refuse").unverified_release == "refuse"
    assert PatchsetCallback("qwen3", unverified_release="trust").unverified_release == "trust"
    with pytest.raises(InvalidArgument, match=r"PatchsetCallback\(unverified=...\)='sometimes'"):
        PatchsetCallback("qwen3", unverified="sometimes")
    with pytest.raises(InvalidArgument, match="disagree"):
        PatchsetCallback("qwen3", unverified="refuse", unverified_release="trust")


def test_the_callbacks_unverified_refuse_refuses_a_users_file(tmp_path: Path) -> None:
    import engine
    from engine.errors import PatchError
    from engine.integrations.transformers import PatchsetCallback
    from engine.tiny import build_tiny_model

    mine = tmp_path / "mine.yaml"  # content of the user's own: not known verified on any release
    mine.write_text("name: mine\nmodel_types: [qwen3]\npatches:\n  - {target: Qwen3RMSNorm, op: rms_norm, scale: weight}\n")
    model = build_tiny_model("qwen3")
    args = SimpleNamespace(device=torch.device("cpu"))
    with pytest.raises(PatchError, match="refuse"):
        PatchsetCallback(str(mine), unverified="refuse").on_init_end(args, None, None, model=model)
    assert not engine.is_patched(model)


def test_every_launcher_takes_unverified_under_its_own_name() -> None:
    from engine.integrations import llamafactory, ms_swift

    assert "unverified" in llamafactory.OUR_KEYS
    assert ms_swift.Settings.from_env({"PATCH_ENGINE_UNVERIFIED": "refuse"}).unverified_release == "refuse"
    with pytest.raises(ValueError, match="PATCH_ENGINE_UNVERIFIED='x'"):
        ms_swift.Settings.from_env({"PATCH_ENGINE_UNVERIFIED": "x"})
    source = (ROOT / "engine" / "integrations" / "axolotl.py").read_text()
    assert "patchset_unverified: Literal" in source  # the model needs axolotl to import (tests/test_axolotl.py)
    twinkle = (ROOT / "engine" / "integrations" / "twinkle.py").read_text()
    assert "unverified: str | None = None" in twinkle  # PatchsetPatch and kernel_mapping (tests/test_twinkle.py)
