"""Rendering the audit table (:mod:`engine.commands.audit_table`): Markdown for docs/audit.md, and a PNG.

The picture is the table at a glance: one row per stack, one column per model type, two panels
(fp32, bf16), each cell coloured by the worst difference the audit found relative to the original's
own rounding error there (bit-equal, within the judge, beyond it by up to 100x, beyond 100x), and
grey or hatched where nothing could be judged (unchecked, the patch raised, it changed nothing).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["BEGIN", "END", "render_markdown", "render_png", "replace_section"]

BEGIN = "<!-- audit table: begin (python -m engine.commands.audit_table) -->"
END = "<!-- audit table: end -->"
_STACK_NAMES = {"liger": "Liger", "hf-kernels": "HF kernels", "twinkle": "twinkle", "llamafactory-v1": "LlamaFactory v1",
                "patchset": "ours"}


def _cells(data: dict[str, Any]) -> dict[tuple[str, str, str], dict[str, Any]]:
    return {(c["stack"], c["model_type"], c["dtype"]): c for c in data["cells"]}


def _word(c: dict[str, Any] | None) -> str:
    if c is None:
        return "-"
    verdict = c["verdict"]
    text = c.get("text", "").replace("|", "/").replace("\n", " ")
    if verdict == "passes":
        return f"passes ({text})"
    if verdict in ("not claimed", "not run"):
        return "not claimed" if verdict == "not claimed" else "not run yet"
    if verdict == "differs" and c.get("reading_only"):  # rests on an interpreter's or emulator's reading: not bolded
        return f"differs ({c.get('reading', 'a reading')}'s reading only): {text}"
    return f"**{verdict}**: {text}" if verdict == "differs" else f"{verdict}: {text}"


def render_markdown(data: dict[str, Any], *, png: str) -> str:
    cells = _cells(data)
    carried = sum(1 for c in data["cells"] if c.get("previous"))
    lines = [BEGIN, "", (f"Generated in {data['generated_in_seconds'] / 60:.0f} min by `{data['command']}` (tiny "
                         "models, a probe batch of 2 x 16 tokens, training mode; each cell one audit, its time in the "
                         "last column).")]
    if carried:
        waiting = sum(1 for c in data["cells"] if c["verdict"] == "not run")
        lines[-1] += (f" {len(data['cells']) - carried - waiting} cells are this audit's; {carried} are carried over "
                      "from the previous table (an earlier version of the audit), and the time column says `previous "
                      f"audit` for each of them; {waiting} are not run yet.")
    under = [c for c in data["cells"] if c.get("conditions")]
    if under and len(under) < len(data["cells"]):
        lines[-1] += (f" {len(under)} cells were also judged under the conditions of use (those of "
                      "`engine/_data/conditions.yaml` marked `audit` that apply to the model), and their rows' time "
                      "column says `with conditions`; the others were judged on the probe only (`probe only`).")
    lines.append("")
    lines += ["| stack | version | transformers | torch | model types claimed | time |", "|---|---|---|---|---|---|"]
    for stack, info in data["stacks"].items():
        types = info.get("types", [])
        claimed = f"{len(types)}" if not info.get("error") else f"0 ({info['error']})"
        lines.append(f"| {_STACK_NAMES.get(stack, stack)} | {info.get('version', '-')} | {info.get('transformers', '-')} "
                     f"| {info.get('torch', '-')} | {claimed} | {info.get('seconds', 0) / 60:.1f} min |")
    lines += ["", f"![audit: stacks x model types, coloured by the worst error relative to the original's own]({png})", ""]
    for stack in data["stacks"]:
        if stack == "patchset":
            continue
        types = sorted({t for (s, t, _) in cells if s == stack})
        if not types:
            continue
        lines += [f"### {_STACK_NAMES.get(stack, stack)}", "",
                  "| model type | fp32 | bf16 | ours (fp32 / bf16) | time |", "|---|---|---|---|---|"]
        for t in types:
            mine = [cells.get(("patchset", t, d)) for d in ("fp32", "bf16")]
            ours = " / ".join(m["verdict"] if m else "-" for m in mine) if any(mine) else "no patchset bundled"
            seconds = sum(cells[(stack, t, d)].get("seconds", 0) for d in ("fp32", "bf16") if (stack, t, d) in cells)
            lines.append(f"| {t} | {_word(cells.get((stack, t, 'fp32')))} | {_word(cells.get((stack, t, 'bf16')))} "
                         f"| {ours} | {seconds:.0f} s{_previous(cells, stack, t)} |")
        lines.append("")
    lines.append(END)
    return "\n".join(lines) + "\n"


def _previous(cells: dict[tuple[str, str, str], dict[str, Any]], stack: str, model_type: str) -> str:
    """Which of a row's cells are carried over from the previous table (not this audit's): '' when none; where some
    cells of the table were judged under the conditions of use, whether this row's were (``with conditions``) or not
    (``probe only``)."""
    def old(s: str) -> list[str]:
        return [d for d in ("fp32", "bf16") if (cells.get((s, model_type, d)) or {}).get("previous")]

    def judged(s: str, under: bool) -> list[str]:
        return [d for d in ("fp32", "bf16") if (s, model_type, d) in cells and cells[(s, model_type, d)]["verdict"]
                not in ("not run", "not claimed") and bool(cells[(s, model_type, d)].get("conditions")) == under]
    mixed = any(c.get("conditions") for c in cells.values())
    parts = []
    if mixed and judged(stack, True):
        parts.append("with conditions" + ("" if len(judged(stack, True)) == 2 else f" ({judged(stack, True)[0]})"))
    for who, dtypes in (("", old(stack)), ("ours ", old("patchset"))):
        if dtypes:
            parts.append(who + ("" if len(dtypes) == 2 else dtypes[0] + " ") + "previous audit")
    if mixed and (judged(stack, False) or judged("patchset", False)) and parts[-1:] != ["with conditions"]:
        parts[-1:] = [(parts[-1] + ", " if parts else "") + "probe only"]
    return ", " + "; ".join(parts) if parts else ""


def replace_section(text: str, section: str) -> str:
    """``text`` with the part between :data:`BEGIN` and :data:`END` replaced (appended where there is none)."""
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        return head + section.rstrip("\n") + rest.split(END, 1)[1]
    return text.rstrip("\n") + "\n\n" + section


def _colour(c: dict[str, Any] | None) -> tuple[str, str]:
    """(face colour, hatch) of one cell."""
    if c is None or c["verdict"] == "not claimed":
        return "white", ""
    if c["verdict"] == "not run":
        return "white", "xx"
    verdict, ratio = c["verdict"], c.get("worst_ratio")
    if verdict in ("unchecked", "error"):
        return "#bdbdbd", "//" if verdict == "error" else ""
    if verdict == "unchanged":
        return "#eeeeee", ".."
    if verdict == "passes":
        return ("#1a9850" if not ratio else "#91cf60"), ""
    if c.get("reading_only"):
        return "#fddbc7", "\\\\"
    if ratio is None or ratio <= 3:
        return "#fee08b", ""
    return ("#fc8d59" if ratio <= 100 else "#d73027"), ""


def render_png(data: dict[str, Any], path: Path, *, rows_per_panel: int = 80) -> None:
    """Model types down, stacks x dtypes across, in side-by-side panels: readable at a page's width.

    Why this way round: 150 model types across made labels of a few pixels at page width; ten narrow
    columns (five stacks, two dtypes) with the types as rows keep every label at a legible size.
    """
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    cells = _cells(data)
    stacks = [s for s in data["stacks"] if any(k[0] == s for k in cells)]
    types = sorted({t for (s, t, _), c in cells.items() if c["verdict"] != "not claimed"})
    columns = [(s, d) for s in stacks for d in ("fp32", "bf16")]
    panels = max(1, math.ceil(len(types) / rows_per_panel))
    rows = math.ceil(len(types) / panels)
    fig, axes = plt.subplots(1, panels, figsize=(3.4 * panels, 1.6 + 0.16 * rows), squeeze=False)
    for p, ax in enumerate(axes[0]):
        mine = types[p * rows:(p + 1) * rows]
        for i, t in enumerate(mine):
            for j, (stack, dtype) in enumerate(columns):
                face, hatch = _colour(cells.get((stack, t, dtype)))
                ax.add_patch(Rectangle((j, i), 1, 1, facecolor=face, hatch=hatch, linewidth=0.6,
                                       edgecolor="#999999" if hatch else "white"))
        ax.set_xlim(0, len(columns))
        ax.set_ylim(rows, 0)
        ax.set_yticks([i + 0.5 for i in range(len(mine))], mine, fontsize=7)
        ax.set_xticks([j + 0.5 for j in range(len(columns))],
                      [f"{_STACK_NAMES.get(s, s)} {d}" for s, d in columns], rotation=90, fontsize=7)
        ax.xaxis.tick_top()
        ax.tick_params(length=0)
        for spine in ax.spines.values():
            spine.set_visible(False)
    fig.suptitle("audit: worst difference relative to the original's own rounding error", fontsize=9)
    legend = [Patch(facecolor="#1a9850", label="bit-equal"), Patch(facecolor="#91cf60", label="passes (within 3x)"),
              Patch(facecolor="#fee08b", label="differs, <= 3x (another declaration)"),
              Patch(facecolor="#fc8d59", label="differs, 3-100x"), Patch(facecolor="#d73027", label="differs, > 100x"),
              Patch(facecolor="#fddbc7", hatch="\\\\", label="differs on an interpreter/emulator reading only"),
              Patch(facecolor="#bdbdbd", label="unchecked"), Patch(facecolor="#bdbdbd", hatch="//", label="patch raised"),
              Patch(facecolor="#eeeeee", hatch="..", label="changes nothing"),
              Patch(facecolor="white", edgecolor="#999999", hatch="xx", label="not run yet"),
              Patch(facecolor="white", edgecolor="#999999", label="not claimed")]
    fig.legend(handles=legend, loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 1.1 / (1.6 + 0.16 * rows), 1, 0.97))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
