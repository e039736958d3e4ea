"""Issue 11, scenario 5: a device this machine does not have is refused before anything changes.

``apply(model_on_cpu, device="cuda")`` on a CPU machine used to patch and then crash inside
Triton at the first forward; ``patch-engine verify qwen3 --device cuda`` ended in a Triton
traceback. Now both raise :class:`DeviceNotAvailable` (a :class:`DeviceUnsupported`) naming
the requested device, where the model's parameters are and the current accelerator; the CLI
exits 2. ``plan`` stays a dry run for any device.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from snapshots import assert_same, snapshot

import engine
from engine.commands.cli import main
from engine.runtime.devices import current_device, is_present
from engine.schema import Device

#: A device type this machine lacks (cuda on the CPU machines CI runs on).
ABSENT = next((d for d in (Device.cuda, Device.xpu, Device.mps) if not is_present(d)), None)
pytestmark = pytest.mark.skipif(ABSENT is None, reason="every device type is present here")


def test_apply_for_a_device_that_is_not_there_is_refused(qwen3: torch.nn.Module) -> None:
    assert ABSENT is not None
    before = snapshot(qwen3)
    with pytest.raises(engine.DeviceUnsupported) as info:
        engine.apply(qwen3, "qwen3", device=ABSENT.value)
    assert isinstance(info.value, engine.DeviceNotAvailable) and isinstance(info.value, engine.PatchError)
    message = str(info.value)
    assert f"device {ABSENT.value!r} was requested" in message
    assert "the model's parameters are on cpu" in message
    assert f"current accelerator: {current_device().value}" in message
    assert "engine.plan(model, patchset" in message  # how to see the decisions without patching
    assert not engine.is_patched(qwen3)
    assert_same(before, snapshot(qwen3))
    # the same model, with the device left to the engine: planned where its parameters are, and exact
    report = engine.apply(qwen3, "qwen3")
    try:
        assert report.device == "cpu"
        ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            patched = qwen3(input_ids=ids).logits
        engine.revert(qwen3)
        with torch.no_grad():
            unpatched = qwen3(input_ids=ids).logits
        assert (patched - unpatched).abs().max().item() <= 1e-5
    finally:
        engine.revert(qwen3)


def test_plan_for_an_absent_device_is_still_a_dry_run(qwen3: torch.nn.Module) -> None:
    assert ABSENT is not None
    the_plan = engine.plan(qwen3, "qwen3", device=ABSENT.value)
    assert the_plan.device is ABSENT and the_plan.patched


def test_cli_verify_on_an_absent_device_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert ABSENT is not None
    assert main(["verify", "qwen3", "--device", ABSENT.value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage error: ") and "Traceback" not in err
    assert f"no {ABSENT.value} device" in err and f"current accelerator: {current_device().value}" in err
    assert main(["verify", "qwen3", "--device", ABSENT.value, "--json"]) == 2
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and data["type"] == "DeviceNotAvailable"
    assert main(["plan", "qwen3", "--device", ABSENT.value]) == 0  # a dry run is fine


def test_cli_verify_on_an_absent_device_exits_2_as_a_process() -> None:
    assert ABSENT is not None
    proc = subprocess.run(
        [sys.executable, "-m", "engine", "verify", "qwen3", "--device", ABSENT.value],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "DeviceNotAvailable" not in proc.stderr
    # in the command line's words (flags, not Python arguments): engine/commands/advice.py
    assert f"--device {ABSENT.value}: this machine has no {ABSENT.value} device" in proc.stderr
