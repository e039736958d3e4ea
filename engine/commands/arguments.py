"""The command line's shared options: ``--unverified``, a checkpoint's (``verify --model/--gguf``), ``-q``.

Torch-free, like the parser that uses them (``validate`` and ``schema`` import neither torch nor transformers).
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator

from engine.foundation.release_policy import ENV_VAR as RELEASE_ENV_VAR
from engine.foundation.release_policy import POLICIES

__all__ = ["checkpoint_arguments", "quiet_argument", "release_argument", "release_policy"]


def quiet_argument(p: argparse.ArgumentParser, steps: str = "a line a step") -> None:
    """``-q``: no progress (on stderr: a tqdm bar on a terminal, else :class:`engine.commands.steps.Steps`' lines)."""
    p.add_argument("-q", "--quiet", action="store_true", help=f"no progress (a bar on a terminal, else {steps})")


def release_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--unverified", "--unverified-release", dest="unverified_release", choices=POLICIES, default=None,
                   help="content not known verified on the installed transformers (your own patchset, an edited "
                        "bundled one, a release outside its range): verify it first (default; a cached verdict), "
                        f"refuse it, or trust it (default: ${RELEASE_ENV_VAR}, else verify; --unverified-release is "
                        "its old name)")


@contextlib.contextmanager
def release_policy(value: str | None) -> Iterator[None]:
    """``--unverified`` for everything the command calls: the engine's own variable, for the command's time.

    Why the variable: every entry point reads it where no keyword says otherwise (the planner,
    a tiny model's build, coverage, a checkpoint's verification), so one flag reaches them all.
    """
    with _variable(RELEASE_ENV_VAR, value):
        yield


@contextlib.contextmanager
def _variable(name: str, value: str | None) -> Iterator[None]:
    """``$name`` set to ``value`` for the block (left as it is where ``value`` is None), put back after it."""
    if value is None:
        yield
        return
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def conditions_argument(p: argparse.ArgumentParser) -> None:
    """verify's ``--conditions``: which conditions of use the whole model is also judged under."""
    p.add_argument("--conditions", default=None, metavar="WHICH",
                   help="conditions of use the whole model is also judged under (engine/_data/conditions.yaml: "
                        "padding, -100 labels, eval, no_grad, bf16/fp16/autocast, repeated calls, an optimizer step, "
                        "decoding with the cache, ...): all (default), budget (what apply runs), none, or names "
                        "separated by commas; each is one more run of the model and its truth")


@contextlib.contextmanager
def conditions_scope(value: str | None) -> Iterator[None]:
    """``--conditions`` for everything the command verifies: the engine's own variable, for the command's time (as
    :func:`release_policy`: a checkpoint's, a tiny model's and zero configuration's verification all read it)."""
    if value is None:
        yield
        return
    from engine.verification.conditions import ENV_VAR, declared  # torch: only where verify runs

    try:  # a wrong name fails here, named, before anything runs
        declared(value if value in ("all", "budget", "none") else value.split(","))
    except ValueError as exc:
        from engine.errors import InvalidArgument

        raise InvalidArgument(f"--conditions {value}: {exc}") from None
    with _variable(ENV_VAR, value):
        yield


def checkpoint_arguments(p: argparse.ArgumentParser) -> None:
    """verify's options for a user's checkpoint instead of a tiny model (docs/verification.md)."""
    p.add_argument("--model", metavar="PATH", help="verify on this checkpoint: a from_pretrained folder")
    p.add_argument("--gguf", metavar="FILE", help="verify on this checkpoint: a .gguf file (needs the gguf package)")
    p.add_argument("--text", metavar="FILE", help="text to run (default: a bundled English text)")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens of the text to use (default: 512)")
    p.add_argument("--mode", choices=("training", "inference"), help="how the model runs (default: inference)")
    p.add_argument("--fused-cross-entropy", action="store_true", help="also fuse the LM head and loss")
    p.add_argument("--sample", action="store_true",
                   help="check the first, middle and last module of each patched class (big models)")
    p.add_argument("--trust-remote-code", action="store_true", help="run code shipped with the checkpoint")
