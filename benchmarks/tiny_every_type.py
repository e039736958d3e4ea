"""A tiny model of every generative type: build ``engine.tiny.build_tiny_model(TYPE)`` and run it.

For every causal-LM and image-text-to-text model type of the installed transformers
(:func:`engine.tiny.config.generative_types`), build the tiny model from the type's derived
config (its defaults shrunk by rule, plus ``engine/tiny/types.yaml``), run one forward of token
ids (a text-only probe, as the scaffold and the verifier run it), and record: built or the
reason it is not, the class built, its parameter count and the seconds it took. A composite that
cannot run on token ids (its forward requires pixel_values, or its vision tower needs a package
not installed) is built as its language model (:func:`engine.tiny.subject.tiny_subject`), and the
row says so.

    nice -n 10 python benchmarks/tiny_every_type.py --out benchmarks/results/tiny_every_type.json
    python benchmarks/tiny_every_type.py llama mistral3 gemma3n     # a few types, printed
    python benchmarks/tiny_every_type.py --out FILE --update TYPES  # rerun those types in FILE

The suite builds a sample (tests/test_tiny_every_type.py); this is the full sweep, its
results committed. One process for all types: a type that fails does not stop the sweep.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from engine.tiny.subject import tiny_subject
from engine.tiny.config import generative_types


def _reason(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def build_one(model_type: str) -> dict[str, Any]:
    """One type's row: ``built`` (and ``runs``), the class, parameters, seconds; or the reason."""
    from engine.runtime.hub_functions import torch_path
    from engine.verification.probes import probe_batch

    start = time.perf_counter()
    row: dict[str, Any] = {"built": False, "runs": False}
    try:
        subject = tiny_subject(model_type)
        model = subject.model
        row.update(built=True, model_class=type(model).__name__,
                   parameters=sum(p.numel() for p in model.parameters()))
        if subject.note:  # a composite that does not run on token ids: its language model stands in
            row.update(tiny_type=subject.tiny_type, note=subject.note)
        batch = probe_batch(model, seq=8)
        with torch.no_grad(), torch_path(model):
            model(**{k: v for k, v in batch.items() if k != "labels"})
        row["runs"] = True
    except Exception as exc:  # noqa: BLE001  (the row says why; the sweep goes on)
        row["reason"] = _reason(exc)
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("types", nargs="*", help="model types (default: every generative type)")
    parser.add_argument("--out", type=Path, help="write the results JSON here")
    parser.add_argument("--update", action="store_true", help="with --out and TYPES: rerun those, keep the other rows")
    parser.add_argument("--memory-gb", type=float, default=8.0,
                        help="address-space limit of this process (a type the rules miss fails, not the machine)")
    args = parser.parse_args(argv)
    import resource

    limit = int(args.memory_gb * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    import transformers

    types = args.types or generative_types()
    rows: dict[str, dict[str, Any]] = {}
    if args.update and args.out and args.out.is_file():  # rerun some types, keep the others' rows
        rows = dict(json.loads(args.out.read_text(encoding="utf-8"))["types"])
    for model_type in types:
        rows[model_type] = build_one(model_type)
        r = rows[model_type]
        print(f"{model_type:32s} {'runs' if r['runs'] else 'built' if r['built'] else 'FAILS':6s} "
              f"{r['seconds']:7.2f}s {r.get('reason', '')[:160]}", flush=True)
    rows = dict(sorted(rows.items()))
    runs = sum(r["runs"] for r in rows.values())
    summary = {"transformers": transformers.__version__, "torch": torch.__version__, "types": len(rows),
               "built": sum(r["built"] for r in rows.values()), "runs": runs,
               "seconds": round(sum(r["seconds"] for r in rows.values()), 1)}
    print(json.dumps(summary), file=sys.stderr)
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "types": rows}, indent=1) + "\n", encoding="utf-8")
    return 0 if runs == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
