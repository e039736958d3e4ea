"""What the tests of training stacks share: a tiny Qwen3 on disk, a loss recorder, a wrong patchset, the loss check.

LlamaFactory (its ``run_exp`` recipe and its v1 API), twinkle, axolotl and ms-swift load a model
by path, so the model is a tiny perturbed Qwen3 written with ``save_pretrained`` next to a
byte-level BPE tokenizer built here (Qwen's chat tokens as specials: any text encodes, nothing is
downloaded), and the data is 16 alpaca rows in ``data/tiny_sft.json`` (with LlamaFactory's
``dataset_info.json`` beside it; the other stacks take the file's path).

Each stack's tests compare a patched training with the same training unpatched, step by step, bit
for bit (``assert_same_losses``): the kernels are the torch references (conftest sets
``PATCH_ENGINE_COMPILE=0``), verification leaves every random state as it found it, so LoRA's
dropout draws the same masks in both runs, and nothing else may differ.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml
from transformers import PreTrainedTokenizerFast, TrainerCallback

from engine.loader import load_patchset
from engine.tiny import build_tiny_model

STEPS = 4
#: Patched layers of a 2-layer Qwen3 under the bundled qwen3 patchset: 9 RMSNorms, 2 MLPs, 1 rope.
PATCHED_MODULES = 12
#: LoRA's dropout in the LoRA runs: what LlamaFactory v1 and PEFT users run (0.05), so verification's
#: effect on the random state would show.
LORA_DROPOUT = 0.05


def installed(package: str) -> bool:
    """Whether ``package`` can be imported here (without importing it)."""
    return importlib.util.find_spec(package) is not None


class LossRecorder(TrainerCallback):
    """Every logged training loss (``logging_steps: 1``: one per optimizer step)."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))


def alpaca_rows() -> list[dict[str, str]]:
    return [{"instruction": f"Add {a} and {b}.", "input": "", "output": f"{a} plus {b} is {a + b}."}
            for a in range(4) for b in range(4)]


def byte_level_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
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
    rows = alpaca_rows()
    (root / "data").mkdir(parents=True)
    (root / "data" / "tiny_sft.json").write_text(json.dumps(rows))
    (root / "data" / "dataset_info.json").write_text(json.dumps({"tiny_sft": {"file_name": "tiny_sft.json"}}))
    tokenizer = byte_level_tokenizer([r["instruction"] + " " + r["output"] for r in rows] + ["system user assistant"])
    tokenizer.save_pretrained(root / "model")
    model = build_tiny_model("qwen3", {"head_dim": 16, "vocab_size": len(tokenizer)}, seed=0)
    model.save_pretrained(root / "model")
    return root


#: The policy setting that applies a patchset without verifying it first (``unverified='trust'``): by default a
#: patchset of the user's own is verified on the installed release before it patches, so a wrong declaration is
#: refused before step 1; the tests that show a wrong declaration *would* change the losses must ask for trust.
TRUST = {"PATCH_ENGINE_UNVERIFIED": "trust"}


def wrong_norms(folder: Path) -> str:
    """The bundled qwen3 patchset, copied to a file, with its ``weight`` norms declared ``1 + weight``."""
    wrong = load_patchset("qwen3").model_dump(mode="json", exclude_none=True)
    for patch in wrong["patches"]:
        if patch["op"] == "rms_norm":
            patch["scale"] = "one_plus_weight"
    path = folder / "qwen3_wrong_norm.yaml"
    path.write_text(yaml.safe_dump(wrong))
    return str(path)


def write_distribution(folder: Path, name: str, version: str, modules: dict[str, str]) -> Path:
    """An installed distribution in ``folder`` (put it on ``sys.path``): its modules' sources and a ``.dist-info``.

    For the import failures a user meets (a dependency that raises while it is imported), where the
    real broken package cannot be installed in a test venv: ``modules`` maps ``"pkg/mod.py"`` to source.
    """
    for relative, source in modules.items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    info = folder / f"{name}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    tops = sorted({relative.split("/")[0].removesuffix(".py") for relative in modules})
    (info / "top_level.txt").write_text("\n".join(tops) + "\n")
    return folder


@contextlib.contextmanager
def launcher_output(*loggers: str, exclude: tuple[str, ...] = ()) -> Iterator[io.StringIO]:
    """What the named loggers' own console handlers print in the block.

    Why swap the handlers' streams instead of capturing stdout: a launcher's handler keeps the stream it
    was made with (pytest's capture of an earlier test, here), so only its own handler shows what a user
    sees: at the launcher's level, with its filters and format. ``exclude``: handler names to leave
    alone (axolotl's ``ax_file_only``, a stream into its debug.log).
    """
    buffer, swaps = io.StringIO(), []
    for name in loggers:
        for handler in logging.getLogger(name).handlers:
            if type(handler) is logging.StreamHandler and handler.get_name() not in exclude:
                swaps.append((handler, handler.setStream(buffer)))
    assert swaps, f"no console handler on {loggers}: is the launcher's logging configured?"
    try:
        yield buffer
    finally:
        for handler, stream in swaps:
            handler.setStream(stream)


def assert_one_line(output: str, *, verified: bool) -> str:
    """The launcher's default output holds the report's one line, once, and not the full report; the line."""
    lines = [line for line in output.splitlines() if "patch-engine: patchset" in line]
    assert len(lines) == 1, f"expected the one line once in the launcher's output:\n{output}"
    line = lines[0]
    assert f"{PATCHED_MODULES} patched, 0 skipped; kernels rms_norm: " in line, line
    assert ("verification passed (" in line) == verified and ("not verified" in line) != verified, line
    assert "patch-engine report:" not in output, "the full report is for the launcher's verbose level"
    print(f"the launcher's default output shows:\n{line}")
    return line


def assert_same_losses(patched: list[float], unpatched: list[float]) -> None:
    """The patched run's loss equals the unpatched run's at every step, bit for bit; and the baseline trained."""
    assert len(unpatched) == STEPS and unpatched[-1] < unpatched[0], f"the baseline did not train: {unpatched}"
    table = "\n".join(f"  step {i + 1}: patched {p!r} unpatched {u!r}{'' if p == u else '  <- differs'}"
                      for i, (p, u) in enumerate(zip(patched, unpatched, strict=False)))
    assert patched == unpatched, f"patched losses differ from unpatched:\n{table}"
    print(f"losses (patched == unpatched, bit for bit):\n{table}")  # shown with -s / -rP: the run's loss table
