"""Coverage: for every model type transformers knows, is there a bundled patchset, does it
verify, and how much of the model does it patch.

Why the parameter share: "we have a YAML for it" says little when the YAML patches only the
norms (well under 1% of the parameters) while the MLPs (most of them) run eagerly. The share
is measured on the family's *default* config (the flagship sizes), built on the meta device
so that no memory is allocated, planned with the bundled patchset: the parameters under
every patched module over all parameters. Function patches (rope, linear attention) hold no
parameters; the patchset column names them.

``patch-engine coverage --out docs/coverage.md`` writes the table; verifying every bundled
patchset takes a minute or two on 2 CPU cores, so the full sweep is a command, not a test.

The rows are every causal-LM and image-text-to-text type of the installed transformers (and every
bundled type). A type with no bundled patchset gets the measured column
(:mod:`engine.commands.coverage_measured`): what zero configuration patches on it, verified, or why
nothing is; ``--measure`` runs that sweep (resumable, its data committed under benchmarks/results/).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from engine.schema import Patchset

__all__ = [
    "LIGER_MODEL_TYPES", "CoverageRow", "bundled_by_type", "coverage_rows", "parameter_share", "render_markdown", "rows_from_page",
    "tiny_model_type", "verify_patchset",
]

#: The keys of Liger-Kernel 0.8.5's ``MODEL_TYPE_TO_APPLY_LIGER_FN`` (liger_kernel/transformers/
#: monkey_patch.py): the peer's list, for the headline of the coverage table.
LIGER_MODEL_TYPES: tuple[str, ...] = (
    "deepseek_v2", "deepseek_v3", "deepseek_v4", "gemma", "gemma2", "gemma3_text", "gemma3", "gemma4_text",
    "gemma4", "glm4", "glm4v", "glm4v_moe", "gpt_oss", "internvl", "llama", "llama4_text", "llama4", "llava",
    "granite", "mllama", "mllama_text_model", "ministral", "mistral", "mixtral", "muse_glimmer", "nemotron",
    "olmo2", "pixtral", "olmo3", "qwen2", "qwen3", "qwen3_moe", "qwen2_vl", "qwen2_vl_text", "qwen2_5_vl",
    "qwen2_5_vl_text", "qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_vl",
    "qwen3_vl_text", "qwen3_vl_moe", "qwen3_vl_moe_text", "smollm3", "phi3", "paligemma", "falcon_h1", "smolvlm",
    "hunyuan_v1_dense", "hunyuan_v1_moe", "exaone4",
)


@dataclass
class CoverageRow:
    """One model type: its bundled patchsets, whether the primary one verifies, its parameter share."""

    model_type: str
    patchsets: list[str]
    verified: bool | None = None  # None: no patchset, or not run
    share: float | None = None  # parameters under patched modules / all parameters (default config)
    patched: str = ""  # what the primary patchset patches, by op
    note: str = ""
    #: Zero configuration on a type with no bundled patchset: the scaffold's measured patchset, verified
    #: on the type's tiny model (engine.commands.coverage_measured); None where not measured.
    measured: dict[str, Any] | None = None

    @property
    def generative(self) -> bool:
        from engine.tiny.config import generative_types

        return self.model_type in _generative(tuple(generative_types()))

    @property
    def covered(self) -> bool:
        """Patched and verified: its bundled patchset verifies, or its measured one does."""
        return bool(self.verified) or bool(self.measured and self.measured.get("verified"))


@functools.cache
def _generative(types: tuple[str, ...]) -> frozenset[str]:
    return frozenset(types)


def bundled_by_type() -> dict[str, list[str]]:
    from engine.loader import bundled_names, load_patchset

    by_type: dict[str, list[str]] = {}
    for name in bundled_names():
        for model_type in load_patchset(name).model_types:
            by_type.setdefault(model_type, []).append(name)
    return by_type


def _primary(model_type: str, names: list[str]) -> str:
    """The patchset named after the type (``qwen3``, not the opt-in ``qwen3_flce``), else the first."""
    return model_type if model_type in names else names[0]


def parameter_share(model: nn.Module, patchset: str) -> tuple[float, str]:
    """``(share of parameters under patched modules, ops patched)`` for ``model`` under ``patchset``."""
    from engine.planning.planner import plan

    the_plan = plan(model, patchset, device="cpu", mode="training")
    modules = dict(model.named_modules())
    paths = sorted({d.path for d in the_plan.patched if d.site is None})
    covered: set[int] = set()
    for path in paths:
        covered.update(id(p) for p in modules[path].parameters())
    params = {id(p): p.numel() for p in model.parameters()}
    total = sum(params.values())
    ops = sorted({d.op for d in the_plan.patched})
    return (sum(params[i] for i in covered if i in params) / total if total else 0.0), ", ".join(ops)


def _default_model(model_type: str) -> nn.Module:
    """The type's default (full-size) causal LM on the meta device: sizes without memory.

    A default ``head_dim`` of ``None`` that the model does not derive itself (hunyuan,
    ministral) is set to ``hidden_size // num_attention_heads``, what such checkpoints have.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type)
    if getattr(cfg, "head_dim", 0) is None and getattr(cfg, "num_attention_heads", None):
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(cfg)


def tiny_model_type(patchset: Patchset) -> str:
    """The model type of the patchset's tiny model: ``tiny_model.model_type``, else its first model type."""
    tiny = patchset.tiny_model
    return (tiny.model_type if tiny and tiny.model_type else None) or patchset.model_types[0]


def _tiny_model(patchset: str | Patchset) -> nn.Module:
    from engine.loader import load_patchset
    from engine.runtime.release import check_release
    from engine.tiny import build_tiny_model

    ps = patchset if isinstance(patchset, Patchset) else load_patchset(patchset)
    check_release(ps, tiny_model_type(ps))  # the version refusal comes before anything is built
    tiny = ps.tiny_model
    return build_tiny_model(tiny_model_type(ps), tiny.config if tiny else {}, random_buffers=tiny.random_buffers if tiny else None)


def verify_patchset(patchset: str | Patchset, *, code: dict[str, str] | None = None) -> tuple[bool, str]:
    """What ``patch-engine verify NAME`` says: the tiny model of the family, patched, verified.

    ``code``, where given, receives the identity of each class and function that was patched and
    verified (:func:`engine.releases.code.patched_code`): what the matrix records as verified.
    Raises whatever building the tiny model or planning raises (the callers make it a row).
    """
    from engine.kernels import compiled
    from engine.patching.patcher import apply, revert
    from engine.verification.runner import verify

    # As a fresh `patch-engine verify NAME` process: compiled kernels are not shared with the
    # types verified before. A kernel compiled (dynamic shapes) for another family's shapes
    # rounds ~1e-7 differently, and qwen3_5_moe's fp32 linear-attention conv1d gradient turns
    # that into 2.5e-4 relative, past the fp32 tolerance (only in a one-process sweep).
    compiled.clear_cache()
    model = _tiny_model(patchset)
    applied = apply(model, patchset, device="cpu")
    if code is not None:
        from engine.releases.code import patched_code

        code.update(patched_code(model, applied.decisions))
    try:
        report = verify(model, raise_on_failure=False)
    finally:
        revert(model)
    failing = sorted({c.cls for c in report.failures})
    return report.passed, ("" if report.passed else "fails: " + ", ".join(failing))


def _refusal(patchset: str) -> str | None:
    """Why ``patchset`` is refused under the installed transformers (the version refusal), else ``None``."""
    from engine.errors import VersionMismatch
    from engine.loader import load_patchset
    from engine.runtime.release import check_release

    try:
        ps = load_patchset(patchset)
        check_release(ps, tiny_model_type(ps))
    except VersionMismatch as exc:
        return _reason(exc)
    except Exception:  # noqa: BLE001  (any other problem is the verification's to report)
        return None
    return None


def _reason(exc: Exception, limit: int = 200) -> str:
    """An exception as one short line for a table cell."""
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def default_types(patchsets: dict[str, list[str]] | None = None) -> list[str]:
    """Every generative type of the installed transformers (causal LM, image-text-to-text), and every bundled type."""
    from engine.tiny.config import generative_types

    return sorted(set(generative_types()) | set(bundled_by_type() if patchsets is None else patchsets))


def types_to_measure(model_types: Iterable[str] | None = None) -> list[str]:
    """The generative types among ``model_types`` with no bundled patchset: the measured column's."""
    from engine.tiny.config import generative_types

    bundled, generative = bundled_by_type(), set(generative_types())
    return [t for t in (model_types or default_types()) if t in generative and t not in bundled]


def coverage_rows(
    model_types: Iterable[str] | None = None, *, verify: bool = True, patchsets: dict[str, list[str]] | None = None,
    measured: dict[str, dict[str, Any]] | None = None, step: Callable[[str], Any] | None = None,
) -> list[CoverageRow]:
    """One row per model type (default: :func:`default_types`).

    ``patchsets`` maps a model type to its patchsets (names or paths; default: the bundled ones).
    A patchset that fails to build, plan or verify is a row saying why; the sweep goes on.
    ``measured``: the measured column's entries by type (:mod:`engine.commands.coverage_measured`).
    ``step``: called after each type with what it found (the command's progress, :mod:`engine.commands.steps`).
    """
    by_type = bundled_by_type() if patchsets is None else patchsets
    verified: dict[str, tuple[bool, str]] = {}
    rows = []
    for model_type in sorted(model_types or default_types(patchsets)):
        row = CoverageRow(model_type, by_type.get(model_type, []))
        rows.append(row)
        _row(row, model_type, verify, verified, measured)
        if step is not None:
            found = {True: "verifies", False: "does not verify", None: "not verified (--no-verify)"}[row.verified]
            step(f"{model_type}: {found if row.patchsets else 'no bundled patchset'}")
    return rows


def _row(row: CoverageRow, model_type: str, verify: bool, verified: dict[str, tuple[bool, str]],
         measured: dict[str, dict[str, Any]] | None) -> None:
    """Fill one type's row: its measured entry, or its primary patchset's refusal, verdict and share."""
    if not row.patchsets:
        row.measured = (measured or {}).get(model_type)
        return
    primary = _primary(model_type, row.patchsets)
    refusal = _refusal(primary)
    if refusal is not None:  # not for this release: that is the row's whole answer
        row.verified, row.note = False, refusal
        return
    if verify:
        if primary not in verified:  # a patchset for several types is verified once
            try:
                verified[primary] = verify_patchset(primary)
            except Exception as exc:  # noqa: BLE001  (a row says what went wrong; the sweep goes on)
                verified[primary] = (False, _reason(exc))
        row.verified, row.note = verified[primary]
    _measure_share(row, model_type, primary)


def _measure_share(row: CoverageRow, model_type: str, primary: str) -> None:
    """The row's share on the default config, else on the tiny model, else none: with the reason in the note.

    Why never raise: a patchset that fails to plan (its target renamed in this transformers) is a
    row that says so; one such row once stopped the whole table (dots1 under transformers 5.6).
    """
    def add(note: str) -> None:
        if note not in row.note:
            row.note = (row.note + "; " if row.note else "") + note

    try:
        row.share, row.patched = parameter_share(_default_model(model_type), primary)
        return
    except Exception as exc:  # noqa: BLE001  (a default config that does not build: the tiny model's share)
        default_error = exc
    try:
        row.share, row.patched = parameter_share(_tiny_model(primary), primary)
        add(f"share on the tiny model: the default config does not build ({type(default_error).__name__})")
    except Exception as exc:  # noqa: BLE001  (it does not plan or build here: no share, and why)
        add(f"no share: {_reason(exc)}")


def rows_from_page(text: str) -> list[CoverageRow]:
    """The bundled rows of a page :func:`render_markdown` wrote (verdict, share, ops, note), read back.

    Why: verifying every bundled patchset is the slow part of the page; the measured column's sweep
    runs beside it and may finish later, so the page is rendered again from the bundled rows as they
    were verified (``patch-engine coverage --bundled-from docs/coverage.md``), not verified twice.
    """
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 7 or cells[1] in ("-", "measured", "patchset") or set(cells[0]) <= {"-"}:
            continue
        share = float(cells[3].rstrip("%")) / 100 if cells[3].endswith("%") else None
        verified = {"yes": True, "**no**": False}.get(cells[2])
        rows.append(CoverageRow(cells[0], [p.strip() for p in cells[1].split(",")], verified, share,
                                "" if cells[4] == "-" else cells[4], note=cells[6]))
    return rows


def _percent(share: float | None) -> str:
    if share is None:
        return "-"
    return f"{100 * share:.1f}%" if share >= 0.001 else f"{100 * share:.3f}%"


def render_markdown(rows: list[CoverageRow]) -> str:
    """docs/coverage.md: a headline, then one row per model type (covered types first)."""
    import transformers

    covered = [r for r in rows if r.patchsets]
    ran = [r for r in covered if r.verified is not None]
    passing = [r for r in ran if r.verified]
    liger = [t for t in LIGER_MODEL_TYPES if any(r.model_type == t for r in rows)]
    liger_covered = [t for t in liger if any(r.model_type == t and r.patchsets for r in rows)]
    shares = sorted(r.share for r in covered if r.share is not None)
    median = shares[len(shares) // 2] if shares else None
    generative = [r for r in rows if r.generative]
    by_bundle = [r for r in generative if r.verified]
    by_measure = [r for r in generative if not r.verified and r.covered]
    lines = [
        "# Coverage",
        "",
        f"Generated by `patch-engine coverage --out docs/coverage.md` with transformers "
        f"{transformers.__version__}; do not edit by hand. The measured column comes from "
        "`patch-engine coverage --measure` (its data: benchmarks/results/coverage_measured.json).",
        "",
    ]
    if covered and not ran:  # --no-verify: say what was not checked, not "0 verified"
        n, bundled, version = len(generative), sum(1 for r in generative if r.patchsets), transformers.__version__
        unchecked = (f"with a bundled patchset are **not verified by this run** (`--no-verify`; `patch-engine "
                     "coverage` without it verifies them)")
        lines.append(
            f"- **{len(by_measure)}** of the {n} causal-LM and image-text-to-text types of transformers {version} "
            f"are patched and verified: {len(by_measure)} by declarations the scaffold measured on the type's tiny "
            f"model (`--measure`'s data); the {bundled} {unchecked}." if by_measure else
            f"- The {bundled} of the {n} causal-LM and image-text-to-text types of transformers {version} {unchecked}."
        )
    elif generative:
        n, done = len(generative), len(by_bundle) + len(by_measure)
        lines.append(
            f"- **{done}** of the {n} causal-LM and image-text-to-text types of transformers "
            f"{transformers.__version__} are patched and verified ({100 * done / n:.0f}%): {len(by_bundle)} by a "
            f"bundled patchset, {len(by_measure)} by declarations the scaffold measured on the type's tiny model "
            f"(what `engine.apply(model)` with no patchset does); the other {n - done} say why in their note."
        )
    lines += [
        f"- **{len(covered)}** of {len(rows)} model types have a bundled patchset; "
        + (f"**{len(passing)}** of the {len(ran)} verified pass `patch-engine verify`." if ran
           else "`patch-engine verify` not run on them (verifies: `-`)."),
        f"- Liger-Kernel 0.8.5 patches {len(LIGER_MODEL_TYPES)} model types; {len(liger_covered)} of them have a "
        f"bundled patchset here: {', '.join(liger_covered) or '-'}.",
        f"- Share of parameters under patched modules (covered types): median {_percent(median)}; "
        f"{sum(1 for x in shares if x > 0.5)} of {len(shares)} patch more than half of the model (their MLPs); "
        "the others leave more unpatched: MLPs no op computes (xIELU, relu², parallel experts), some "
        "routed experts, or large embeddings and vision towers (composite and small models).",
        "",
        "*share*: parameters under patched modules over all parameters, on the type's default (full-size) "
        "config built on the meta device. A norms-only patchset patches well under 1%; one that patches "
        "the MLPs, most of the model. Function patches (rope, linear attention) hold no parameters.",
        "",
        "| model_type | patchset | verifies | share | patched ops | Liger 0.8.5 | note |",
        "|---|---|---|---|---|---|---|",
    ]
    ordered = sorted(rows, key=lambda r: (not r.patchsets, not r.covered, r.model_type))
    for r in ordered:
        patchset, verified, patched, note = ", ".join(r.patchsets) or "-", r.verified, r.patched, r.note
        if not r.patchsets and r.measured is not None:  # zero configuration: the scaffold's measured declarations
            m = r.measured
            patchset, verified, patched = "measured", m.get("verified"), m.get("ops", "")
            note = "; ".join(x for x in (m.get("note", ""), m.get("reason", "")) if x).replace("|", "/")
        verdict = {True: "yes", False: "**no**", None: "-"}[verified]
        lines.append(
            f"| {r.model_type} | {patchset} | {verdict} | {_percent(r.share)} | "
            f"{patched or '-'} | {'yes' if r.model_type in LIGER_MODEL_TYPES else ''} | {note} |"
        )
    return "\n".join(lines) + "\n"
