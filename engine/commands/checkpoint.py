"""Verify a patchset on a user's own checkpoint: load it, tokenize a text, compare perplexities.

Why: a patch meets real activation ranges (outlier activations, trained norm weights) only on a
trained checkpoint and real tokens; tiny models with random weights do not have them. This is
what ``patch-engine verify PATCHSET --model PATH`` (or ``--gguf FILE``) runs:

1. :func:`~engine.commands.checkpoints.load_checkpoint`: the model and its tokenizer from a
   ``from_pretrained`` folder or a ``.gguf`` file (transformers de-quantizes it to ``dtype``);
   remote code only when asked. ``patch-engine bench --checkpoint`` loads with the same function.
2. :func:`text_batch`: one sequence of real tokens (labels = input ids), by default the bundled
   :data:`DEFAULT_TEXT` (the opening of Jane Austen's *Pride and Prejudice*, 1813, public domain).
3. :func:`verify_checkpoint`: perplexity unpatched, then apply, verify every patched module on the
   activations of those tokens and the whole model (:func:`engine.verify` with ``batch=``),
   perplexity patched, and revert: the model is left as it was loaded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.api import revert, verify
from engine.commands.checkpoints import load_checkpoint
from engine.errors import InvalidArgument
from engine.patching.patcher import apply as patch
from engine.planning.report import Report, from_files
from engine.verification import VerifyReport

__all__ = [
    "DEFAULT_TEXT",
    "CheckpointVerification",
    "default_text",
    "load_checkpoint",
    "perplexity",
    "text_batch",
    "verify_checkpoint",
    "verify_checkpoint_files",
]

#: The bundled text verification runs on when none is given (a few hundred tokens of English prose).
DEFAULT_TEXT = "verify_text.txt"

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def default_text() -> str:
    """The bundled English text (shipped in the wheel as ``engine/_data/verify_text.txt``)."""
    return resources.files("engine").joinpath("_data", DEFAULT_TEXT).read_text(encoding="utf-8")


def text_batch(tokenizer: Any, text: str, *, max_tokens: int | None = None, device: Any = None) -> dict[str, torch.Tensor]:
    """One sequence of ``text``'s tokens (at most ``max_tokens``): input ids, attention mask, labels.

    Labels are the input ids (the model shifts them), so the loss is the mean next-token loss.
    """
    encoded = tokenizer(text, return_tensors="pt", truncation=max_tokens is not None, max_length=max_tokens)
    ids = encoded["input_ids"]
    if ids.shape[-1] < 2:
        raise InvalidArgument(f"the text has {ids.shape[-1]} token(s); verification needs at least 2")
    mask = encoded.get("attention_mask", torch.ones_like(ids))
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}
    return {k: v.to(device) for k, v in batch.items()} if device is not None else batch


def perplexity(model: nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """``exp`` of the model's mean next-token loss on ``batch`` (no gradients)."""
    with torch.no_grad():
        loss = model(**batch).loss
    return math.exp(float(loss))


@dataclass
class CheckpointVerification:
    """What :func:`verify_checkpoint` measured: perplexities, the apply report and the verification."""

    perplexity_unpatched: float
    perplexity_patched: float
    tokens: int
    applied: Report
    report: VerifyReport
    #: Where the model and text came from, for the printed header (set by :func:`verify_checkpoint_files`).
    source: dict[str, str] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return self.report.passed

    def perplexity_lines(self) -> list[str]:
        change = (self.perplexity_patched / self.perplexity_unpatched - 1) * 100
        return [
            f"perplexity unpatched {self.perplexity_unpatched:.4f}",
            f"perplexity patched   {self.perplexity_patched:.4f} ({change:+.4f}%)",
        ]

    def text(self, *, detail: bool = False) -> str:
        """A header naming the patchset, checkpoint and text; the perplexities; the verification table."""
        a, src = self.applied, self.source
        head = (f"verify {a.patchset!r}{from_files(a.files)} on {src.get('checkpoint', 'a model')} "
                f"({src.get('model', '-')}, {a.model_type}, {a.device}, {src.get('dtype', '-')}, {a.mode}), "
                f"{self.tokens} tokens of {src.get('text', 'text')}")
        from engine.commands.verify_table import report_text  # grouped by class, within 120 columns

        return "\n".join([head, *self.perplexity_lines(), report_text(self.report, detail=detail)])

    def to_dict(self) -> dict[str, Any]:
        a = self.applied
        return {"ok": self.passed, "patchset": a.patchset, "file": a.file, **self.source,
                "model_type": a.model_type, "device": a.device, "mode": a.mode,
                "tokens": self.tokens,
                "perplexity": {"unpatched": self.perplexity_unpatched, "patched": self.perplexity_patched},
                **self.report.to_dict()}


def verify_checkpoint(
    model: nn.Module,
    patchset: Any,
    batch: dict[str, torch.Tensor],
    *,
    mode: str = "inference",
    device: Any = None,
    fused_cross_entropy: Any = None,
    modules: str = "all",
    steps: Any = None,
) -> CheckpointVerification:
    """Perplexity unpatched; apply; verify on ``batch``; perplexity patched; revert.

    ``mode`` is how the model runs: ``training`` (``model.train()``, kernels with a backward,
    the fused head computing the loss) or ``inference`` (``model.eval()``). ``modules="sample"``
    checks the first, middle and last module of each patched class (see :func:`engine.verify`).
    The model is reverted before this returns, also when verification fails. ``steps``: an
    :class:`engine.commands.steps.Steps` told each of :data:`STEPS` (minutes on a real checkpoint).
    """
    steps = steps or _Silent()
    model.train(mode == "training")
    before = perplexity(model, batch)
    steps.step(f"perplexity unpatched {before:.4f}")
    # the patcher, not the facade: this verification, on the user's own weights, is the release's too
    applied = patch(model, patchset, device=device, mode=mode, fused_cross_entropy=fused_cross_entropy)
    steps.step(f"patched {len(applied.patched)} modules and functions; next the original's run and its fp64 truth, "
               "then each module checked, then the whole model")
    try:
        checked = _Checked(steps)
        report = verify(model, batch=batch, modules=modules, raise_on_failure=False, progress=checked)
        checked.finish()
        after = perplexity(model, batch)
        steps.step(f"perplexity patched {after:.4f}")
    finally:
        revert(model)
    return CheckpointVerification(before, after, int(batch["input_ids"].numel()), applied, report)


def verify_checkpoint_files(
    patchset: str,
    *,
    model: str | None = None,
    gguf: str | None = None,
    text: str | None = None,
    max_tokens: int | None = 512,
    dtype: str = "fp32",
    mode: str = "inference",
    device: str | None = None,
    fused_cross_entropy: Any = None,
    modules: str = "all",
    trust_remote_code: bool = False,
    steps: Any = None,
) -> CheckpointVerification:
    """What ``patch-engine verify PATCHSET --model PATH | --gguf FILE`` runs, from paths and names.

    Everything a user typed is checked before the checkpoint is loaded (that takes a while):
    the patchset, the text file, the dtype, the device. ``steps``: told each of :data:`STEPS`.
    """
    from engine.loader import load_patchset
    from engine.runtime.devices import as_device, current_device, is_present
    from engine.runtime.release import check_release

    if text is not None and not Path(text).is_file():
        raise InvalidArgument(f"--text {text}: no such file")
    if max_tokens is not None and max_tokens < 2:
        raise InvalidArgument(f"--max-tokens {max_tokens}: verification needs at least 2 tokens")
    if dtype not in DTYPES:
        raise InvalidArgument(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    ps = load_patchset(patchset)
    check_release(ps)  # before the checkpoint is loaded
    dev = as_device(device or "cpu")
    if not is_present(dev):
        from engine.commands.advice import device_missing

        raise device_missing(dev.value, current_device().value, [patchset] if isinstance(patchset, str) else [],
                             interpret=False)
    steps = steps or _Silent()
    name = Path(str(gguf or model)).name
    steps.note(f"loading {name}")
    loaded, tokenizer = load_checkpoint(model, gguf=gguf, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
    loaded.to(dev.value)
    words = Path(text).read_text(encoding="utf-8") if text is not None else default_text()
    batch = text_batch(tokenizer, words, max_tokens=max_tokens, device=dev.value)
    steps.step(f"loaded {name} ({type(loaded).__name__}, {dtype}), {int(batch['input_ids'].numel())} tokens")
    done = verify_checkpoint(loaded, ps, batch, mode=mode, device=dev, fused_cross_entropy=fused_cross_entropy,
                             modules=modules, steps=steps)
    done.source = {"checkpoint": str(gguf or model), "model": type(loaded).__name__, "dtype": dtype,
                   "text": text or "the bundled text"}
    return done


#: What a checkpoint's verification tells its ``steps``, in order (``patch-engine verify --gguf``'s progress).
STEPS = ("loaded", "perplexity unpatched", "patched", "modules checked", "the whole model checked", "perplexity patched")


class _Silent:
    def step(self, text: str) -> None: ...

    def note(self, text: str) -> None: ...


class _Checked:
    """The verifier's ``progress=`` callback: a note each tenth of the modules, a step when all are checked and one
    for the whole model (checked in one run whose original pass records the modules' inputs)."""

    def __init__(self, steps: Any):
        self.steps, self.checked, self.modules, self.whole = steps, 0, None, False

    def __call__(self, done: int, total: int, what: str) -> None:
        if what.startswith("under "):  # the whole model under a condition of use (after the whole model's step)
            self.steps.note(f"the whole model {what} ({done - self.checked - 1}/{total - self.checked - 1})")
            return
        self.modules = total - 1
        if what == "the whole model":
            self.whole = True
            self.steps.step("the whole model checked: logits, loss and every gradient")
            return
        self.checked += 1
        if self.checked == self.modules:
            self.steps.step(f"modules checked {self.checked}/{self.modules}")
        elif self.checked * 10 // self.modules > (self.checked - 1) * 10 // self.modules:
            self.steps.note(f"modules checked {self.checked}/{self.modules} ({what})")

    def finish(self) -> None:
        """The steps the verification did not reach (a module never called; no whole model), so the count ends whole."""
        if self.modules is None or self.checked < self.modules:
            self.steps.step(f"modules checked {self.checked}/{self.modules or self.checked}")
        if not self.whole:
            self.steps.step("the whole model: not checked")
