"""``patch-engine plan`` and ``verify`` with no patchset: zero configuration, as ``engine.apply(model)`` does it.

``patch-engine plan --model-type olmo`` (or ``--model FOLDER``, remote code with
``--trust-remote-code``) shows what :func:`engine.apply` with no patchset would patch on a tiny
model: the bundled patchset of the type, else the declarations measured on it, verified (the
verdict cached), and what is left unpatched and why. ``patch-engine verify --model-type olmo``
applies it and runs the verifier. ``auto`` names the same; ``measure`` measures even where a
bundled patchset exists. ``--json`` prints the report with its ``zero_config`` part.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from engine.errors import InvalidArgument

__all__ = ["plan_zero_config", "verify_zero_config"]

EXIT_OK, EXIT_FAILED = 0, 1


def _model(args: argparse.Namespace, command: str) -> Any:
    """The model ``plan``/``verify`` with no patchset work on: a tiny one of ``--model-type``, or of a folder's config."""
    if getattr(args, "model", None) and command == "plan":
        from engine.scaffolding.source import model_from_folder

        return model_from_folder(args.model, trust_remote_code=args.trust_remote_code)[0]
    if args.model_type:
        from engine.tiny import build_tiny_model

        return build_tiny_model(args.model_type)
    where = "--model-type TYPE or --model FOLDER" if command == "plan" else "--model-type TYPE"
    raise InvalidArgument(f"{command} with no patchset (zero configuration: the bundled patchset of the model's type, "
                          f"else declarations measured on it) needs a model: {where}")


def plan_zero_config(args: argparse.Namespace) -> int:
    """``plan`` with no patchset (or ``auto``/``measure``): what ``engine.apply(model)`` would patch, and why."""
    from engine.planning.planner import plan
    from engine.planning.report import Report, format_decisions
    from engine.zeroconfig import choose

    from engine.runtime.devices import as_device, current_device, is_present

    model = _model(args, "plan")
    # a dry run for a device this machine lacks (plan --device cuda on a CPU): measured and verified here, then planned
    # for that device; apply there verifies the measured declarations again with its kernels (said below)
    absent = args.device is not None and not is_present(as_device(args.device))
    here = current_device().value if absent else args.device
    choice = choose(model, args.patchset, device=here, mode=args.mode)
    if choice.patchset is None:
        assert choice.empty is not None
        report = choice.empty
        if absent:  # nothing to plan for: the decisions are none on any device
            report.device = as_device(args.device).value
    else:
        report = Report.from_plan(plan(model, choice.patchset, device=args.device, mode=args.mode))
        report.zero_config = choice.record
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(f"plan (zero configuration) for a tiny {report.model_type} ({type(model).__name__}) on {report.device} "
              f"({report.mode}): patchset {report.patchset!r}")
        print(choice.record)
        if absent and choice.record.source != "bundled":
            print(f"verification: this machine has no {args.device}, so the measured declarations were verified on "
                  f"a tiny copy here ({here}, its kernels); on a machine with {args.device}, applying them (engine.apply, "
                  f"patch-engine verify --model-type {report.model_type} --device {args.device}) verifies them again "
                  f"with the {args.device} kernels below first (a verdict cached per device)")
        print(format_decisions(report.decisions, detail=args.detail))
    return EXIT_OK


def verify_zero_config(args: argparse.Namespace) -> int:
    """``verify`` with no patchset: ``engine.apply(tiny)`` with zero configuration, then the verifier on it."""
    import engine

    if args.model or args.gguf or args.interpret:
        raise InvalidArgument(_no_patchset_for(args))
    model = _model(args, "verify")
    from engine.runtime.devices import as_device, current_device, is_present

    if args.device and not is_present(as_device(args.device)):  # before a tiny copy is measured on it
        from engine.commands.advice import device_missing

        target = [args.patchset] if args.patchset else []
        raise device_missing(args.device, current_device().value, [*target, "--model-type", args.model_type],
                             interpret=False)
    applied = engine.apply(model, args.patchset, device=args.device or "cpu")
    try:
        report = engine.verify(model, raise_on_failure=False) if applied.patched else None
    finally:
        if engine.is_patched(model):
            engine.revert(model)
    passed = report is None or report.passed
    if args.json:
        data = {"ok": passed, "patchset": applied.patchset, "model_type": applied.model_type,
                "model": type(model).__name__, "device": applied.device, "zero_config": applied.zero_config.to_dict(),
                **(report.to_dict() if report is not None else {"checks": []})}
        print(json.dumps(data, indent=2))
    else:
        print(f"verify (zero configuration) on a tiny {applied.model_type} ({type(model).__name__}, {applied.device})")
        print(applied.zero_config)
        from engine.commands.verify_table import report_text  # grouped by class, within 120 columns

        print(report_text(report) if report is not None else "nothing patched, nothing to verify")
    return EXIT_OK if passed else EXIT_FAILED


def _no_patchset_for(args: argparse.Namespace) -> str:
    """Why ``verify`` with no patchset refuses ``--model``/``--gguf``/``--interpret``, and the commands that do it."""
    import shlex

    if args.interpret:
        return ("--interpret runs a patchset's CUDA plan on a tiny model: name the patchset "
                "(patch-engine verify qwen3 --interpret); zero configuration measures on the model's own device")
    if args.model:
        folder = shlex.quote(args.model)
        return (f"verify with no patchset runs on a tiny model of --model-type TYPE; for a checkpoint, measure its "
                f"declarations first (patch-engine scaffold --model {folder} --out measured.yaml), then "
                f"patch-engine verify measured.yaml --model {folder}")
    return ("verify with no patchset runs on a tiny model of --model-type TYPE; for a .gguf checkpoint, name the "
            f"bundled patchset of its model type (a Llama: patch-engine verify llama --gguf {shlex.quote(args.gguf)})")
