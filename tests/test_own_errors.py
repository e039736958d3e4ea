"""Issue 11, scenario 8: every refusal is an error of our own type, with the fix in the message.

A bad ``tiny_model.config`` printed a raw traceback from inside transformers,
``engine.verify(unpatched_model)`` raised a bare ``ValueError``, and ``mode="train"`` was
silently planned as inference (kernels without a backward for a training run). Each is now a
:class:`PatchError` that is also a ``ValueError`` (what PyTorch users catch for bad values).
"""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path

import pytest
import torch
from snapshots import assert_same, snapshot

import engine
from engine.commands.cli import main
from engine.kernels import registry
from engine.loader import load_patchset
from engine.tiny import build_tiny_for


def _own(exc: BaseException) -> None:
    assert isinstance(exc, engine.PatchError) and isinstance(exc, ValueError), type(exc).__mro__


@pytest.mark.parametrize(
    ("config", "parts"),
    [
        ("{head_dim: 0}", ["tiny_model.config.head_dim", "0 is not a valid size", "positive integer"]),
        ("{num_hidden_layers: -2}", ["tiny_model.config.num_hidden_layers", "-2 is not a valid size"]),
        ("{hidden_size: '64'}", ["tiny_model.config.hidden_size", "'64' is a str", "take an int", "without quotes"]),
        ("{layer_types: [full_attention]}", ["tiny_model.config", "building a tiny qwen3 model from it failed",
                                              "layer_types"]),
        ("{num_attention_heads: 3}", ["tiny_model.config", "building a tiny qwen3 model from it failed"]),
    ],
)
def test_bad_tiny_model_config_is_a_patchset_error(
    config: str, parts: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text(textwrap.dedent(f"""\
        name: mine
        extends: qwen3
        tiny_model:
          config: {config}
        """))
    with pytest.raises(engine.PatchsetError) as info:
        build_tiny_for(load_patchset(str(path)))
    _own(info.value)
    for part in parts:
        assert part in str(info.value)
    assert main(["verify", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "Traceback" not in err and all(p in err for p in parts)


def test_verify_of_an_unpatched_model_says_what_to_do(qwen3: torch.nn.Module) -> None:
    with pytest.raises(engine.NotPatched) as info:
        engine.verify(qwen3)
    _own(info.value)
    assert "Qwen3ForCausalLM is not patched" in str(info.value)
    assert "engine.apply(model, patchset)" in str(info.value) and "engine.verify(model, 'qwen3')" in str(info.value)


@pytest.mark.parametrize(("mode", "hint"), [("train", "training"), ("eval", "inference"), ("infrence", "inference")])
def test_a_mode_typo_is_refused_not_planned_as_inference(qwen3: torch.nn.Module, mode: str, hint: str) -> None:
    before = snapshot(qwen3)
    for call in (engine.plan, engine.apply):
        with pytest.raises(engine.InvalidArgument) as info:
            call(qwen3, "qwen3", device="cpu", mode=mode)  # type: ignore[arg-type]
        _own(info.value)
        assert f"mode={mode!r} is not a mode" in str(info.value) and f"did you mean mode={hint!r}" in str(info.value)
    assert_same(before, snapshot(qwen3))
    assert engine.plan(qwen3, "qwen3", device="cpu", mode="training").mode == "training"


def test_an_unknown_device_name_is_our_error(qwen3: torch.nn.Module) -> None:
    with pytest.raises(engine.InvalidArgument, match="unknown device 'gpu'; expected one of") as info:
        engine.apply(qwen3, "qwen3", device="gpu")
    _own(info.value)
    assert not engine.is_patched(qwen3)


def test_registering_a_kernel_twice_is_our_error() -> None:
    torch_norm = registry.get("torch", "rms_norm")
    with pytest.raises(engine.InvalidArgument, match="already registered; pick another name") as info:
        registry.register(copy.copy(torch_norm))
    _own(info.value)

