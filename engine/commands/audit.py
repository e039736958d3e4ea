"""``patch-engine audit MODEL_TYPE --with PATCH``: judge someone else's patch with the verifier.

The model is the tiny model of the type that ``verify`` builds (the bundled patchset's
``tiny_model`` where one is bundled, so our own patchset and the audited patch meet the same
model), or a checkpoint (``--model PATH``, ``--gguf FILE``) on real tokens. Several ``--with``
are judged against one measurement of the original, in the order given, each on its own copy:
``--with llamafactory-v1 --with patchset:gemma3_text`` judges theirs and ours in one run.
See :mod:`engine.auditing` and docs/audit.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.commands.arguments import quiet_argument
from engine.errors import InvalidArgument, MissingDependency

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["add_parser", "build_model", "run_audit", "tiny_model"]

DTYPES = ("fp32", "bf16")  # names only: the parser is built for every command, `validate` imports no torch


def tiny_model(model_type: str, dtype: torch.dtype | None = None) -> nn.Module:
    """The tiny model ``verify`` builds for ``model_type``: the bundled patchset's ``tiny_model``, else the type's own;
    with the fields every released checkpoint of the type has (``released_configs`` in engine/_data/audit_stacks.yaml)."""
    import torch

    from engine.auditing.adapters.patchset import bundled_by_type
    from engine.loader import load_patchset
    from engine.tiny import build_tiny_for, build_tiny_model
    from engine.tiny.config import derive_tiny_config

    from engine.auditing.adapters.stack_data import stack_data

    dtype = dtype or torch.float32
    released = stack_data("released_configs").get(model_type)  # fields as the released checkpoints have them
    bundled = bundled_by_type().get(model_type)
    if bundled and not released:
        return build_tiny_for(load_patchset(bundled), model_type, dtype=dtype)
    tiny = load_patchset(bundled).tiny_model if bundled else None
    config = dict(tiny.config) if tiny else derive_tiny_config(model_type)
    return build_tiny_model(model_type, {**config, **(released or {})}, dtype=dtype,
                            random_buffers=tiny.random_buffers if tiny else None)


def build_model(args: argparse.Namespace) -> tuple[nn.Module, dict[str, Any] | None, str]:
    """The model, its batch (None: a probe batch) and a line saying what it is."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if args.model or args.gguf:
        from engine.commands.checkpoint import default_text, text_batch
        from engine.commands.checkpoints import load_checkpoint

        if args.model and args.gguf:
            raise InvalidArgument("give --model PATH or --gguf FILE, not both")
        model, tokenizer = load_checkpoint(args.model, gguf=args.gguf, dtype=dtype)
        text = Path(args.text).read_text(encoding="utf-8") if args.text else default_text()
        batch = text_batch(tokenizer, text, max_tokens=args.max_tokens)
        source = f"{args.model or args.gguf} ({type(model).__name__}, {batch['input_ids'].shape[-1]} tokens)"
        if args.model_type and args.model_type != model.config.model_type:
            raise InvalidArgument(f"the checkpoint is a {model.config.model_type}, not a {args.model_type}")
    else:
        if not args.model_type:
            raise InvalidArgument("audit takes a model type (patch-engine audit llama --with liger), or --model/--gguf")
        model, batch = tiny_model(args.model_type, dtype), None
        source = f"a tiny {args.model_type} ({type(model).__name__})"
    model.train(args.mode == "training")
    return model, batch, source


def run_audit(args: argparse.Namespace) -> int:
    from engine.auditing import audit_many, measure_first
    from engine.auditing.adapters import resolve

    if not args.patches:
        raise InvalidArgument("audit needs --with PATCH (liger, twinkle, llamafactory-v1, hf-kernels, patchset:NAME, "
                              "MODULE:FUNCTION)")
    from engine.auditing.conditions import conditions as declared
    from engine.commands.steps import Steps

    started = time.perf_counter()
    conditions = None if args.quick else "default"
    # minutes on a real checkpoint: the model, the original's parts, each patch judged, as they run (stderr)
    with Steps(3 + len(declared(conditions)) + len(args.patches), "audit", quiet=args.quiet) as steps:
        try:
            if args.model_type and not (args.model or args.gguf):  # a bad --with: a usage error before anything is built
                [resolve(p, args.model_type) for p in args.patches]
            steps.note(f"loading {Path(args.model or args.gguf).name}" if args.model or args.gguf else
                       f"building a tiny {args.model_type}")
            model, batch, source = build_model(args)
            adapters = [resolve(p, str(model.config.model_type)) for p in args.patches]
        except MissingDependency as exc:  # the stack's package (or the checkpoint's reader) is not installed here
            print(f"could not run: {exc}", file=sys.stderr)
            return EXIT_COULD_NOT_RUN
        steps.step(f"model: {source}")
        original = measure_first(model, batch, conditions=conditions, progress=lambda done, total, what: steps.step(what))
        reports = audit_many(model, adapters, original=original, progress=_judged(steps))
    seconds = round(time.perf_counter() - started, 1)
    if args.json:
        print(json.dumps({"model": source, "seconds": seconds, "original": original.phases,
                          "audits": [r.to_dict() for r in reports]}, indent=2))
    else:
        from engine.planning.tables import table_width

        phases = ", ".join(f"{k} {v} s" for k, v in original.phases.items())
        print(f"audit on {source}, {args.dtype}, {args.mode}; the original measured first ({original.seconds:.1f} s: "
              f"{phases})")
        with table_width():  # every table within 120 columns: its notes beneath their rows where they do not fit
            for report in reports:
                print()
                print(report if not args.detail else f"{report}\n\n{report.table(detail=True)}")
    return exit_code([r.verdict for r in reports])


def _judged(steps: Any) -> Any:
    """``audit_many``'s progress: a step for each patch judged, a note for where the one being judged has come."""
    finished = [0]

    def progress(done: int, total: int, what: str) -> None:
        if done > finished[0]:
            finished[0] = done
            steps.step(what)
        else:
            steps.note(what)

    return progress


#: ``audit``'s exit codes (``--help`` prints them): the verdicts a script can act on, and "could not run" apart.
EXIT_PASSES, EXIT_DIFFERS, EXIT_USAGE, EXIT_COULD_NOT_RUN = 0, 1, 2, 3
EXIT_HELP = ("exit codes: 0 every patch passes, or is unchanged (logits, loss and every gradient bit-identical to "
             "the original's); 1 a patch differs (a module, function or whole-model value beyond the original's own "
             "rounding error, another declaration, or a change nothing explains); 2 usage error; 3 could not run "
             "(the stack's package is missing, the patch raised, or something it changed could not run here: "
             "unchecked), and nothing differs")


def exit_code(verdicts: list[str]) -> int:
    """1 where any patch differs; else 3 where any could not be run or judged; else 0."""
    if "differs" in verdicts:
        return EXIT_DIFFERS
    if any(v in ("error", "unchecked") for v in verdicts):
        return EXIT_COULD_NOT_RUN
    return EXIT_PASSES


def add_parser(sub: Any) -> None:
    p = sub.add_parser("audit", help="judge someone else's patch (Liger, LlamaFactory, twinkle, HF kernels, a function) "
                                     "with the verifier", epilog=EXIT_HELP)
    p.add_argument("model_type", nargs="?", help="model type of the tiny model (or give --model / --gguf)")
    p.add_argument("--with", dest="patches", action="append", metavar="PATCH",
                   help="liger | twinkle | llamafactory-v1 | hf-kernels | patchset:NAME | MODULE:FUNCTION | "
                        "FILE.py:FUNCTION; repeat to judge several against one original")
    p.add_argument("--dtype", choices=DTYPES, default="fp32", help="dtype of the model")
    p.add_argument("--mode", choices=("training", "inference"), default="training",
                   help="the model's mode while judged (default: training, as these stacks patch for it)")
    p.add_argument("--model", metavar="PATH", help="a from_pretrained checkpoint folder instead of a tiny model")
    p.add_argument("--gguf", metavar="FILE", help="a .gguf checkpoint instead of a tiny model (the gguf package)")
    p.add_argument("--text", metavar="FILE", help="with a checkpoint: text to run (default: a bundled English text)")
    p.add_argument("--max-tokens", type=int, default=128, help="with a checkpoint: tokens of the text (default 128)")
    p.add_argument("--quick", action="store_true",
                   help="the 16-token probe only, without the conditions of use (other lengths, left and right "
                        "padding, -100 labels: engine/_data/conditions.yaml) that run by default")
    p.add_argument("--detail", action="store_true", help="one row per module (not grouped by class)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    quiet_argument(p)
    p.set_defaults(func=run_audit)
