"""A tiny Qwen3 checkpoint folder with a tokenizer and an alpaca data set, for tests of training launchers.

What a launcher (LlamaFactory, twinkle) loads from disk: ``model/`` (a perturbed 2-layer Qwen3
saved with ``save_pretrained`` next to a byte-level BPE tokenizer with Qwen's chat tokens, built
here, so nothing is downloaded) and ``data/`` (16 alpaca rows and LlamaFactory's
``dataset_info.json``).
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from engine.tiny import build_tiny_model


def _alpaca_rows() -> list[dict[str, str]]:
    return [{"instruction": f"Add {a} and {b}.", "input": "", "output": f"{a} plus {b} is {a + b}."}
            for a in range(4) for b in range(4)]


def _byte_level_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A small byte-level BPE with Qwen's chat tokens as specials: any text encodes, nothing is downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


def write_tiny(root: Path) -> Path:
    """Write ``model/`` (tiny perturbed Qwen3 + tokenizer) and ``data/`` (alpaca JSON + dataset_info.json) into ``root``."""
    rows = _alpaca_rows()
    (root / "data").mkdir()
    (root / "data" / "tiny_sft.json").write_text(json.dumps(rows))
    (root / "data" / "dataset_info.json").write_text(json.dumps({"tiny_sft": {"file_name": "tiny_sft.json"}}))
    tokenizer = _byte_level_tokenizer([r["instruction"] + " " + r["output"] for r in rows] + ["system user assistant"])
    tokenizer.save_pretrained(root / "model")
    model = build_tiny_model("qwen3", {"head_dim": 16, "vocab_size": len(tokenizer)}, seed=0)
    model.save_pretrained(root / "model")
    return root
