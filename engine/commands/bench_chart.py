"""``patch-engine bench``'s chart: the ops' speed-ups and the training step's peak memory, as ``<out>/cpu.png``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["chart"]


def chart(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    rows = results.get("ops", [])
    if rows:
        labels = [f"{r['op']}\n{r['dtype']}" for r in rows]
        bars = axes[0].bar(labels, [r["speedup"] for r in rows], color="#4c72b0")
        axes[0].axhline(1.0, color="grey", lw=0.8)
        axes[0].bar_label(bars, fmt="%.1fx")
        axes[0].set_title("op speed-up vs transformers eager (CPU, forward)")
        axes[0].set_ylabel("eager time / patched time")
    train = results.get("train")
    if train:
        mem = train["memory"]
        names = ["unpatched", "qwen3_flce"]
        peaks = [mem["unpatched"]["step_peak_rise_MiB"], mem["patched"]["step_peak_rise_MiB"]]
        bars = axes[1].bar(names, peaks, color=["#dd8452", "#55a868"])
        axes[1].bar_label(bars, fmt="%.0f MiB")
        axes[1].set_title(f"training step peak memory rise\n({train['unpatched_s']:.2f} s vs {train['patched_s']:.2f} s)")
        axes[1].set_ylabel("MiB above the resting model")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
