"""Bounded work and bounded messages for any patchset a user or an attacker writes (issue 38, item 4).

Each case used to cost minutes, gigabytes or a raw traceback: a tiny model of real width built
by a plain ``apply`` (63 s, 9.8 GB), an ``extends`` chain of 2 MB files (killed at 300 s), a 3 MB
``kernel:`` echoed whole, 350,000 unknown keys printing 72 MB, ``function: torch`` ending in a
``TypeError``, a 5,000-character ``extends:`` name in an ``OSError``. Now each is our own error,
with ``file:line``, refused before the expensive part, and short.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

import engine
from engine.errors import PatchsetError, SignatureMismatch
from engine.loader import MAX_BYTES, bundled_names, load_patchset
from engine.loader.extends import MAX_CHAIN_BYTES
from engine.loader.messages import MAX_PROBLEMS
from engine.tiny import build_tiny_for, build_tiny_model
from engine.tiny.budget import MAX_TINY_ELEMENTS, check_tiny_budget, estimate_elements


def _qwen3(**change: Any) -> dict[str, Any]:
    data = load_patchset("qwen3").model_dump(mode="json", exclude_none=True)
    data.update(change)
    return data


def _write(path: Path, data: dict[str, Any] | str) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


# ---- (a) the tiny model's budget -------------------------------------------------------------


def test_every_bundled_tiny_model_is_within_the_budget() -> None:
    """The budget must refuse no bundled patchset's tiny model (checked from the config alone, nothing built)."""
    checked = 0
    for name in bundled_names():
        patchset = load_patchset(name)
        tiny = patchset.tiny_model
        model_type = tiny.model_type if tiny and tiny.model_type else patchset.model_types[0]
        check_tiny_budget(model_type, dict(tiny.config) if tiny else {})  # raises if over
        checked += 1
    assert checked == len(bundled_names()) >= 80


def test_the_estimate_is_of_the_order_of_the_real_model() -> None:
    """Not a count, an estimate by key names: within a few times the real size, and never a blind zero."""
    config = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 128, "head_dim": 16}
    real = sum(p.numel() for p in build_tiny_model("qwen3", config).parameters())
    estimate, _ = estimate_elements(config)
    assert real / 4 < estimate < real * 4


@pytest.mark.parametrize("sizes", [{"hidden_size": 1024, "num_hidden_layers": 48},  # the 63 s, 9.8 GB
                                   {"num_hidden_layers": 10**9}])                   # never reaches a config class
def test_a_tiny_model_over_the_budget_is_refused_before_anything_is_built(tmp_path: Path, sizes: dict) -> None:
    path = _write(tmp_path / "big.yaml", _qwen3(tiny_model={"config": {"head_dim": 16, **sizes}}))
    with pytest.raises(PatchsetError, match=r"over the self-verification's budget of 32.0M; nothing was built") as info:
        build_tiny_for(load_patchset(path))
    assert info.value.file == str(path) and info.value.key == "tiny_model.config"
    assert "layers x hidden" in str(info.value) and MAX_TINY_ELEMENTS == 32_000_000


def test_a_size_left_at_a_flagship_default_counts_too() -> None:
    """A MoE config whose expert count is not given takes its class's default (qwen3_moe: 128 experts)."""
    with pytest.raises(PatchsetError, match="with the config class's defaults"):
        check_tiny_budget("qwen3_moe", {"hidden_size": 512, "moe_intermediate_size": 512})
    check_tiny_budget("qwen3_moe", {"num_experts": 4, "moe_intermediate_size": 32})


# ---- (b) an extends chain's total --------------------------------------------------------------


def test_an_extends_chain_over_its_total_budget_is_refused_before_reading_the_next_file(tmp_path: Path) -> None:
    padding = "#" + "x" * 999 + "\n"
    third = int(MAX_CHAIN_BYTES * 0.4) // len(padding)
    _write(tmp_path / "c.yaml", "name: c\nmodel_types: [qwen3]\npatches: []\n" + padding * third)
    _write(tmp_path / "b.yaml", "name: b\nextends: ./c.yaml\n" + padding * third)
    root = _write(tmp_path / "a.yaml", "name: a\nextends: ./b.yaml\n" + padding * third)
    assert all(p.stat().st_size < MAX_BYTES for p in tmp_path.iterdir())  # each file alone is within its cap
    with pytest.raises(PatchsetError, match=r"extends chain would read .* bytes in 3 files") as info:
        load_patchset(root)
    assert info.value.file == str(tmp_path / "b.yaml") and info.value.line == 2 and info.value.key == "extends"


# ---- (c) echoes and floods ---------------------------------------------------------------------


def test_a_3_mb_value_is_echoed_by_its_ends(tmp_path: Path) -> None:
    data = _qwen3()
    data["patches"][0]["kernel"] = "k" * 3_000_000
    with pytest.raises(PatchsetError, match="unknown kernel") as info:
        load_patchset(_write(tmp_path / "big.yaml", data))
    text = str(info.value)
    assert len(text) < 1000 and "more characters]" in text and info.value.line is not None


def test_thousands_of_unknown_keys_list_a_few_and_count_the_rest(tmp_path: Path) -> None:
    data = _qwen3()
    data["patches"][0].update({f"unknown{i}": 1 for i in range(3000)})
    with pytest.raises(PatchsetError) as info:
        load_patchset(_write(tmp_path / "flood.yaml", data))
    lines = str(info.value).splitlines()
    assert len(lines) == MAX_PROBLEMS + 1 and len(info.value.errors) == MAX_PROBLEMS
    assert lines[0].startswith(f"{tmp_path / 'flood.yaml'}:") and "unknown key 'unknown0'" in lines[0]
    assert lines[-1].startswith(f"... and {3000 - MAX_PROBLEMS:,} more problems not listed ({3000 - MAX_PROBLEMS:,} "
                                "unknown keys)")


# ---- (d) raw exceptions become ours, with file:line -----------------------------------------------


def test_a_5000_character_extends_name_is_our_error_not_an_oserror(tmp_path: Path) -> None:
    path = _write(tmp_path / "long.yaml", "name: x\nmodel_types: [qwen3]\nextends: " + "a" * 5000 + "\npatches: []\n")
    with pytest.raises(PatchsetError, match="the file system cannot look it up") as info:
        load_patchset(path)
    assert (info.value.file, info.value.line, info.value.key) == (str(path), 3, "extends")
    assert len(str(info.value)) < 2000


def test_function_torch_is_a_signature_mismatch_at_its_line(tmp_path: Path) -> None:
    text = (Path(__file__).resolve().parent.parent / "patchsets" / "qwen3.yaml").read_text(encoding="utf-8")
    path = _write(tmp_path / "torch.yaml", text.replace("function: apply_rotary_pos_emb", "function: torch"))
    line = next(i for i, row in enumerate(path.read_text().splitlines(), 1) if "function: torch" in row)
    model = build_tiny_model("qwen3", dict(load_patchset("qwen3").tiny_model.config))
    for call in (engine.plan, engine.apply):
        with pytest.raises(SignatureMismatch, match="'torch' is the module torch, not a rotary function") as info:
            call(model, path, device="cpu")
        assert str(info.value).startswith(f"{path}:")
        assert f":{line - 1}:" in str(info.value) or f":{line}:" in str(info.value)
    assert not engine.is_patched(model)
