"""Train a small Qwen3 with Hugging Face Trainer, patched and unpatched, and plot both loss curves.

The patched run differs from the unpatched one by a single line, the callback::

    Trainer(..., callbacks=[PatchsetCallback("qwen3")])

The data is synthetic: each sequence is a window of a fixed cyclic token pattern, so the
next token is predictable and the loss falls. Both runs start from the same weights and see
the same batches; the script checks that their final losses agree within 1e-3 and writes the
plot to ``--png`` (default ``examples/out/train_tiny.png``, a folder git ignores: running the
example never changes a tracked file; the picture in docs/training.md is ``examples/train_tiny.png``,
written by passing that path).

Usage (a couple of minutes on two CPU cores)::

    python examples/train_tiny.py [--steps 300] [--png PATH]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM, Trainer, TrainingArguments
from transformers.trainer_callback import ProgressCallback

from engine.integrations.transformers import PatchsetCallback

VOCAB, PERIOD, SEQ = 128, 24, 48
TOLERANCE = 1e-3
#: Where the plot goes unless ``--png`` says otherwise: a folder git ignores (.gitignore).
DEFAULT_PNG = Path(__file__).parent / "out" / "train_tiny.png"


def build_model(seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=SEQ, tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config)


def synthetic_dataset(n: int = 512, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Windows of one cyclic pattern of PERIOD distinct tokens, at random offsets."""
    gen = torch.Generator().manual_seed(seed)
    pattern = torch.randperm(VOCAB, generator=gen)[:PERIOD]
    rows = []
    for _ in range(n):
        offset = int(torch.randint(0, PERIOD, (1,), generator=gen))
        ids = pattern[(offset + torch.arange(SEQ)) % PERIOD]
        rows.append({"input_ids": ids, "labels": ids.clone()})
    return rows


class QuietProgress(ProgressCallback):
    """The usual tqdm bar, without printing every step's log line under it."""

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
        pass


def train(*, patched: bool, steps: int, output_dir: str) -> list[float]:
    args = TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=16, learning_rate=3e-3,
        lr_scheduler_type="constant", warmup_steps=0, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, seed=0, disable_tqdm=False,
    )
    # The one line. revert_on_end: this model is thrown away after training, and reverting
    # leaves the process as it was (no rope router left installed for other qwen3 models).
    callbacks: list[Any] = [PatchsetCallback("qwen3", revert_on_end=True)] if patched else []
    trainer = Trainer(model=build_model(), args=args, train_dataset=synthetic_dataset(), callbacks=callbacks)
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(QuietProgress)
    print(f"training {'patched' if patched else 'unpatched'}:")
    trainer.train()
    if patched:
        print(callbacks[0].report)
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


def plot(unpatched: list[float], patched: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(range(1, len(unpatched) + 1), unpatched, label=f"unpatched (final {unpatched[-1]:.4f})", lw=2.5)
    ax.plot(range(1, len(patched) + 1), patched, "--", label=f"patched, qwen3 patchset (final {patched[-1]:.4f})",
            lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.set_title("Tiny Qwen3 on a cyclic token pattern: Trainer, patched vs unpatched")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--png", type=Path, default=DEFAULT_PNG,
                        help="where the plot goes (default: examples/out/, ignored by git)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads; a model this small gains nothing from more, and on a busy machine "
                        "OpenMP threads spinning against other processes made a step 100x slower (2.4 s vs 20 ms)")
    opts = parser.parse_args(argv)
    torch.set_num_threads(opts.threads)
    with tempfile.TemporaryDirectory() as tmp:
        unpatched = train(patched=False, steps=opts.steps, output_dir=f"{tmp}/unpatched")
        patched = train(patched=True, steps=opts.steps, output_dir=f"{tmp}/patched")
    opts.png.parent.mkdir(parents=True, exist_ok=True)
    plot(unpatched, patched, opts.png)
    gap = abs(patched[-1] - unpatched[-1])
    worst = max(abs(a - b) for a, b in zip(patched, unpatched))
    print(f"final loss: unpatched {unpatched[-1]:.6f}, patched {patched[-1]:.6f}, |diff| {gap:.2e} "
          f"(largest per-step |diff| {worst:.2e}); first loss {unpatched[0]:.4f}; wrote {opts.png}")
    if gap > TOLERANCE:
        print(f"final losses differ by more than {TOLERANCE}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
