"""``patch-engine`` (also ``python -m engine``): validate, schema, plan, verify, scaffold, audit, coverage, demo, kernels, bench.

Exit codes: 0 ok, 1 a check failed (invalid patchset, plan refused, verification
failed), 2 usage error (bad arguments: unknown option, device or model type, or a
device this machine does not have). With
``--json`` a refusal is also printed to stdout as ``{"ok": false, "error": ..., "type": ...}``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

from engine.commands.arguments import (
    checkpoint_arguments,
    conditions_argument,
    conditions_scope,
    quiet_argument,
    release_argument,
    release_policy,
)
from engine.commands.cli_words import for_cli
from engine.commands.quiet import others_quiet
from engine.errors import DeviceNotAvailable, InvalidArgument, PatchError

__all__ = ["main"]

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
#: Every command's flag for other packages' warnings and log lines (hidden without it: engine.commands.quiet).
VERBOSE = ("-v", "--verbose")


def _cmd_validate(args: argparse.Namespace) -> int:
    from engine.loader import load_patchset, resolve

    failed = 0
    results = []
    for path in args.files:
        used = path
        try:
            used = str(resolve(path))  # the file actually read: a local copy wins over the bundled one
            ps = load_patchset(used)
        except PatchError as exc:
            failed += 1
            problems = getattr(exc, "errors", None) or [exc]
            errors = [_error_dict(e) for e in problems]
            results.append({"file": used, **_given(path, used), "ok": False, "errors": errors})
            if not args.json:
                print(exc, file=sys.stderr)
        else:
            entry = {"file": used, **_given(path, used), "ok": True, "name": ps.name, "patches": len(ps.patches)}
            if len(ps.files) > 1:
                entry["extends"] = list(ps.files[1:])  # the bases read, in order
            results.append(entry)
            if not args.quiet and not args.json:
                print(f"{used}: ok ({ps.name}, {len(ps.patches)} patches)")
    example = next((r["file"] for r in results if r["ok"]), None)
    if args.json:
        print(json.dumps({"ok": not failed, "checked": "schema", "not_checked": dict(_NOT_VALIDATED),
                          "files": results}, indent=2))
    elif example is not None and not args.quiet:  # "ok" is the schema's word: say what it does not cover
        print(validated_note(example), file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK


#: What ``validate`` does not check, and the command that does.
_NOT_VALIDATED = {"targets": "plan", "numbers": "verify"}


def validated_note(file: str) -> str:
    """What an ``ok`` from ``validate`` means, with the commands that check the rest (runnable as printed)."""
    import shlex

    quoted = shlex.quote(file)
    return (f"validate checked the schema only (every key and value, extends merged). Not checked: whether the "
            f"classes and functions it targets exist in a model and fit (patch-engine plan {quoted}), nor whether "
            f"the patched model computes the original's numbers (patch-engine verify {quoted})")


def _given(given: str, used: str) -> dict[str, str]:
    """``{"given": ...}`` when the file used is not literally what was typed (``qwen3`` -> its path)."""
    return {"given": given} if given != used else {}


def _error_dict(exc: Exception) -> dict[str, Any]:
    """An error as data: its type and text, and for a patchset error its file, line and key."""
    data: dict[str, Any] = {"type": type(exc).__name__, "error": str(exc)}
    for attr in ("file", "line", "key", "problem"):
        if hasattr(exc, attr):
            data[attr] = getattr(exc, attr)
    return data


def _cmd_schema(args: argparse.Namespace) -> int:
    from engine.loader import json_schema

    print(json.dumps(json_schema(), indent=2, sort_keys=True))
    return EXIT_OK


def _tiny_model_for(patchset: Any, model_type: str | None, dtype: str) -> Any:
    import torch

    from engine.tiny import build_tiny_for

    return build_tiny_for(patchset, model_type, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])


def _cmd_plan(args: argparse.Namespace) -> int:
    from engine.api import plan  # the facade's: it says how apply would verify the patchset (Plan.verification)
    from engine.loader import load_patchset
    from engine.zeroconfig import is_zero_config

    if is_zero_config(args.patchset):
        from engine.commands.zero_config import plan_zero_config

        return plan_zero_config(args)
    if args.model or args.trust_remote_code:
        raise InvalidArgument("plan --model FOLDER plans zero configuration for a checkpoint folder: leave the "
                              "patchset out (or give auto / measure)")
    ps = load_patchset(args.patchset)
    model = _tiny_model_for(ps, args.model_type, "fp32")
    the_plan = plan(model, ps, device=args.device, mode=args.mode)
    if args.json:
        from engine.planning.report import Report

        data = Report.from_plan(the_plan).to_dict()
        data["verification"] = {"kind": the_plan.verification.kind, "text": str(the_plan.verification)}
        print(json.dumps(data, indent=2))
    else:
        from engine.planning.report import format_decisions, from_files

        print(f"plan {ps.name!r}{from_files(ps.files)} for a tiny {the_plan.model_type} "
              f"on {the_plan.device.value} ({the_plan.mode})")
        for note in (the_plan.release_note(), the_plan.verification):
            if note:
                print(for_cli(str(note), args.patchset))
        print(format_decisions(the_plan.decisions, detail=args.detail))
    return EXIT_OK


def _cmd_verify(args: argparse.Namespace) -> int:
    from engine.loader import load_patchset
    from engine.runtime.devices import as_device, current_device, is_present
    from engine.schema import Device

    from engine.zeroconfig import is_zero_config

    if is_zero_config(args.patchset):
        from engine.commands.zero_config import verify_zero_config

        return verify_zero_config(args)
    if args.model or args.gguf:
        if args.interpret:
            raise InvalidArgument("--interpret verifies on a tiny model; a checkpoint runs on its own device")
        return _verify_checkpoint(args)
    given = [flag for flag, value in (("--text", args.text), ("--mode", args.mode), ("--sample", args.sample),
                                      ("--fused-cross-entropy", args.fused_cross_entropy),
                                      ("--trust-remote-code", args.trust_remote_code)) if value]
    if given:
        raise InvalidArgument(f"{', '.join(given)} apply to a checkpoint only: add --model PATH or --gguf FILE")
    ps = load_patchset(args.patchset)
    device = as_device(args.device or ("cuda" if args.interpret else "cpu"))
    if args.interpret:
        if device is not Device.cuda:
            raise InvalidArgument(f"--interpret runs the CUDA plan's Triton kernels on this CPU; --device "
                                  f"{device.value} has none: use --device cuda (the default with --interpret)")
    elif not is_present(device):  # before building anything: --device cuda on a CPU machine is a usage error
        from engine.commands.advice import device_missing

        typed = [args.patchset, *(["--model-type", args.model_type] if args.model_type else [])]
        raise device_missing(device.value, current_device().value, typed)
    from engine.commands.verify_tiny import verify_every_type  # every model type the file lists (issue 38)

    return EXIT_OK if verify_every_type(ps, args, device) else EXIT_FAILED


def _verify_checkpoint(args: argparse.Namespace) -> int:
    """``verify PATCHSET --model PATH | --gguf FILE``: the user's checkpoint, on real tokens.

    See :mod:`engine.commands.checkpoint`.
    """
    from engine.commands.checkpoint import STEPS, verify_checkpoint_files
    from engine.commands.steps import Steps

    if args.model and args.gguf:
        raise InvalidArgument("give --model PATH or --gguf FILE, not both")
    if args.model_type:
        raise InvalidArgument("--model-type builds a tiny model; a checkpoint's model type is its config's")
    with Steps(len(STEPS), "verify", quiet=args.quiet) as steps:  # minutes on a real checkpoint: what runs, as it runs
        done = verify_checkpoint_files(
            args.patchset, model=args.model, gguf=args.gguf, text=args.text, max_tokens=args.max_tokens,
            dtype=args.dtype, mode=args.mode or "inference", device=args.device,
            fused_cross_entropy=True if args.fused_cross_entropy else None, trust_remote_code=args.trust_remote_code,
            modules="sample" if args.sample else "all", steps=steps,
        )
    print(json.dumps(done.to_dict(), indent=2) if args.json else done.text(detail=args.detail))
    return EXIT_OK if done.passed else EXIT_FAILED


def _cmd_scaffold(args: argparse.Namespace) -> int:
    from engine.scaffolding import scaffold

    config = json.loads(args.config) if args.config else None
    if (args.model_type is None) == (args.model is None):
        raise InvalidArgument("scaffold takes a model type (patch-engine scaffold llama) or a checkpoint folder "
                              "(patch-engine scaffold --model PATH), one of the two")
    if args.model is None and (args.trust_remote_code or args.weights):
        raise InvalidArgument("--trust-remote-code and --weights are for a checkpoint folder: add --model PATH")
    if args.model is not None:
        from pathlib import Path

        text = scaffold(Path(args.model), config=config, trust_remote_code=args.trust_remote_code,
                        weights=args.weights).to_yaml()
    else:
        text = scaffold(args.model_type, config=config).to_yaml()
    if args.out:
        from pathlib import Path

        Path(args.out).write_text(text)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return EXIT_OK


def _cmd_coverage(args: argparse.Namespace) -> int:
    from engine.commands.coverage import coverage_rows, default_types, render_markdown
    from engine.commands.coverage_measured import load_measured, measure_types

    if args.measure:  # the measured column's sweep: resumes where its data file stops (see coverage_measured)
        from engine.commands.coverage import types_to_measure

        measure_types(types_to_measure(args.model_types or None), args.measured, again=args.remeasure,
                      log=lambda line: print(line, file=sys.stderr, flush=True))
    if args.bundled_from:  # the bundled rows as a page already verified them; the measured column read again
        from pathlib import Path as _Path

        from engine.commands.coverage import CoverageRow, bundled_by_type, rows_from_page

        bundled = {r.model_type: r for r in rows_from_page(_Path(args.bundled_from).read_text(encoding="utf-8"))}
        by_type = bundled_by_type()  # a patchset bundled since the page was written: a row, not verified here
        rows = [bundled.get(t) or CoverageRow(t, by_type.get(t, [])) for t in sorted(args.model_types or default_types())]
    else:
        from engine.commands.steps import Steps

        types = sorted(args.model_types or default_types())
        with Steps(len(types), "coverage", quiet=args.quiet) as steps:  # minutes: what runs, as it runs
            rows = coverage_rows(types, verify=not args.no_verify, step=steps.step)
    measured = load_measured(args.measured)  # read after the bundled ones are verified: a sweep beside it may add to it
    for row in rows:
        row.measured = None if row.patchsets else measured.get(row.model_type)
    text = render_markdown(rows)
    if args.out:
        from engine.commands.coverage_testers import write_page  # keeps the second column's section (its own command)

        write_page(text, args.out)
        print(f"wrote {args.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return EXIT_OK if all(r.verified is not False for r in rows) else EXIT_FAILED


def _cmd_demo(args: argparse.Namespace) -> int:
    from engine.commands.demo import run_demo

    return run_demo(args.patchset, steps=args.steps)


def _cmd_kernels(args: argparse.Namespace) -> int:
    from engine.kernels.registry import all_providers
    from engine.planning.report import format_table

    rows = [
        (p.name, p.op, p.device_list(), ", ".join(d.package for d in p.requires) or "-",
         "yes" if p.has_backward else "no", "yes" if p.compile_safe else "no")
        for p in sorted(all_providers(), key=lambda p: (p.op, p.name))
    ]
    print(format_table(("kernel", "op", "devices", "needs", "backward", "compile-safe"), rows))
    return EXIT_OK


def _cmd_bench(args: argparse.Namespace) -> int:
    from engine.commands.bench import main as bench_main

    return bench_main(args.bench_args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="patch-engine", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("validate", help="validate patchset files against the schema")
    p.add_argument("files", nargs="+")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing for valid files")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("schema", help="print the JSON Schema of patchsets")
    p.set_defaults(func=_cmd_schema)

    for name, func, help_ in (
        ("plan", _cmd_plan, "show what applying a patchset would do, on a tiny model of its family"),
        ("verify", _cmd_verify, "apply to a tiny model and compare patched vs original numerically"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("patchset", nargs="?", default=None,
                       help="bundled name (qwen3) or a .yaml path (qwen3.yaml: ./qwen3.yaml if it exists); left out "
                            "(or auto): zero configuration, the bundled patchset of the model's type, else "
                            "declarations measured on it; measure: measured even where a bundled one exists")
        p.add_argument("--model-type", help="model_type of the tiny model (default: the patchset's)")
        p.add_argument("--device", help="cpu, cuda, npu, xpu, mps (default: current accelerator)")
        p.add_argument("--json", action="store_true", help="machine-readable output")
        release_argument(p)
        if name == "plan":
            p.add_argument("--mode", choices=("training", "inference"), default="training")
            p.add_argument("--detail", action="store_true", help="one row per module")
            p.add_argument("--model", metavar="FOLDER",
                           help="with no patchset: a tiny model of this checkpoint folder's config (remote code too)")
            p.add_argument("--trust-remote-code", action="store_true",
                           help="run the folder's own modeling code (its config.json auto_map); read it first")
        else:
            p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="dtype of the model")
            p.add_argument("--detail", action="store_true", help="also one row per check")
            p.add_argument("--interpret", action="store_true",
                           help="plan for CUDA and run its Triton kernels (liger, fla) on this CPU with Triton's "
                                "interpreter (slow; default device cuda)")
            checkpoint_arguments(p)
            conditions_argument(p)
            quiet_argument(p, "a line a step; with --model/--gguf")
        p.set_defaults(func=func)

    p = sub.add_parser("scaffold", help="measure every op's declarations on a tiny model of a type; print a patchset")
    p.add_argument("model_type", nargs="?", help="a transformers model_type, e.g. llama (or give --model)")
    p.add_argument("--model", metavar="PATH",
                   help="a local checkpoint folder (config.json; remote code too): a tiny model from its config")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the folder's own modeling code (its config.json auto_map); read it first")
    p.add_argument("--weights", action="store_true",
                   help="measure the checkpoint as saved (from_pretrained) instead of a tiny model of its config")
    p.add_argument("--out", help="write the patchset here (default: stdout)")
    p.add_argument("--config", help='JSON of tiny-config keys to override, e.g. \'{"head_dim": 16}\'')
    p.set_defaults(func=_cmd_scaffold)

    from engine.commands.audit import add_parser as add_audit

    add_audit(sub)

    p = sub.add_parser("coverage", help="per model_type: bundled patchset, verifies, share of parameters patched")
    p.add_argument("model_types", nargs="*",
                   help="only these types (default: every causal-LM and image-text-to-text type, and every bundled one)")
    p.add_argument("--out", help="write the Markdown table here (docs/coverage.md); default: stdout")
    p.add_argument("--no-verify", action="store_true", help="skip running verify (fast)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress (a bar on a terminal, else a line a type)")
    p.add_argument("--measure", action="store_true",
                   help="scaffold and verify every generative type without a bundled patchset not yet in --measured")
    p.add_argument("--remeasure", action="store_true", help="with --measure: measure those already in --measured too")
    p.add_argument("--measured", default="benchmarks/results/coverage_measured.json",
                   help="the measured column's data (read, and written by --measure)")
    p.add_argument("--bundled-from", metavar="PAGE",
                   help="take the bundled rows from a page this command wrote (no verification), the measured ones anew")
    release_argument(p)
    p.set_defaults(func=_cmd_coverage)

    p = sub.add_parser("demo", help="patch a small Qwen3 on this device; compare numbers and time")
    p.add_argument("--patchset", default="qwen3")
    p.add_argument("--steps", type=int, default=3, help="timed forward+backward repeats")
    release_argument(p)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("kernels", help="list registered kernel providers")
    p.set_defaults(func=_cmd_kernels)

    p = sub.add_parser("bench", help="benchmark patched vs eager, write JSON + PNG (patch-engine bench --help)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments of engine.commands.bench")
    p.set_defaults(func=_cmd_bench)
    for command in sub.choices.values():
        command.add_argument(*VERBOSE, action="store_true", help="also show other packages' warnings and log lines")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["bench"]:  # its own parser (engine.commands.bench), options passed through untouched
        rest = [a for a in args_list[1:] if a not in VERBOSE]
        with others_quiet(len(rest) < len(args_list) - 1):
            return _cmd_bench(argparse.Namespace(bench_args=rest))
    parser = _parser()
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    try:
        with (release_policy(getattr(args, "unverified_release", None)), others_quiet(args.verbose),
              conditions_scope(getattr(args, "conditions", None))):
            return int(args.func(args))
    except (InvalidArgument, DeviceNotAvailable) as exc:  # the command line asked for something that is not there
        _report_error(args, exc, "usage error")
        return EXIT_USAGE
    except PatchError as exc:
        _report_error(args, exc, "error")
        return EXIT_FAILED
    except ValueError as exc:  # bad argument values (e.g. unknown device or model type)
        _report_error(args, exc, "usage error")
        return EXIT_USAGE


def _report_error(args: argparse.Namespace, exc: Exception, kind: str) -> None:
    print(f"{kind}: {for_cli(str(exc), getattr(args, 'patchset', None))}", file=sys.stderr)  # its flags, not keywords
    if getattr(args, "json", False):
        print(json.dumps({"ok": False, **_error_dict(exc)}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
