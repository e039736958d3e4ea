"""``patch-engine verify FILE``: the patchset verified on a tiny model of every model type it lists.

Why every type: a patchset for ``[qwen3, llama]`` whose tiny model is a llama was verified where
its Qwen3 patches never install; ``verify`` said "passed" and the Qwen3 was patched wrong (issue
38). Each type gets the patchset's ``tiny_model`` where it is for that type, else the scaffold's
tiny config of that type's config class (:func:`engine.releases.self_verify.tiny_for_type`), the
same model ``engine.apply`` verifies a user's patchset on. ``--model-type`` verifies one type.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Any

__all__ = ["verify_every_type"]


def _one(ps: Any, model_type: str, args: argparse.Namespace, device: Any) -> tuple[Any, Any, Any]:
    """``(report of apply, tiny model, verification report)`` of ``ps`` on a tiny ``model_type``."""
    import torch

    from engine.api import revert, verify
    from engine.patching.patcher import apply  # not the facade's: this verification is the release's too
    from engine.releases.self_verify import tiny_for_type

    if args.interpret:
        from engine.kernels.triton_interpret import interpreting

        scope: Any = interpreting()
    else:
        scope = contextlib.nullcontext()
    model = tiny_for_type(ps, model_type, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype])
    if not args.interpret:
        model = model.to(device.value)
    with scope:  # interpreted: the vendor kernels of the CUDA plan run on CPU tensors (Triton's interpreter)
        applied = apply(model, ps, device=device)
        try:
            report = verify(model, raise_on_failure=False)
        finally:
            revert(model)  # releases function routers (matters when main() runs inside a process)
    return applied, model, report


def verify_every_type(ps: Any, args: argparse.Namespace, device: Any) -> bool:
    """Verify ``ps`` on each of its model types (or ``--model-type``), print each; whether every one passed."""
    from engine.commands.verify_table import report_text
    from engine.planning.report import from_files

    types = [args.model_type] if args.model_type else list(dict.fromkeys(ps.model_types))
    rows = []
    for model_type in types:
        applied, model, report = _one(ps, model_type, args, device)
        rows.append({"ok": report.passed, "patchset": ps.name, "file": applied.file, "model_type": applied.model_type,
                     "model": type(model).__name__, "device": applied.device,
                     "outside_verified_range": str(applied.release) if applied.release else None, **report.to_dict()})
        if not args.json:
            print(f"verify {ps.name!r}{from_files(ps.files)} on a tiny {applied.model_type} "
                  f"({type(model).__name__}, {applied.device})")
            if applied.release is not None:
                print(f"{applied.release}: this verification is on the installed release")
            print(report_text(report, detail=args.detail))  # the table grouped by class, within 120 columns
    passed = all(row["ok"] for row in rows)
    if args.json:  # the first type's fields at the top (as for one type), every type under "types"
        print(json.dumps({**rows[0], "ok": passed, **({"types": rows} if len(rows) > 1 else {})}, indent=2))
    elif len(rows) > 1:
        print(f"{ps.name!r} on every model type it lists: " + ", ".join(
            f"{row['model_type']} {'passed' if row['ok'] else 'FAILED'}" for row in rows))
    return passed
