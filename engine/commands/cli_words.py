"""The engine's messages in the command line's words: ``--unverified trust``, not ``unverified='trust'``.

Why: a refusal is written once, for the Python API that most callers use (``engine.apply(model,
..., unverified='trust')``), and the same text reaches a user of ``patch-engine verify`` who has
no keyword to pass: told ``unverified='refuse'``, they cannot act on it. The command line shows
every error, every engine warning and every plan note through :func:`for_cli`, which rewrites
each API phrase that has a command-line equivalent into its flag or command; the API keeps its
wording. Each phrase below is one the engine writes (``engine/releases/gate.py``,
``engine/runtime/release.py``, ``engine/foundation/versions.py``, ``engine/planning``), and
``tests/test_cli_words.py`` reaches each through the command line.
"""

from __future__ import annotations

import re
import shlex

__all__ = ["for_cli"]

_POLICY = re.compile(r"\bunverified(?:_release)?=(['\"])(verify|refuse|trust)\1")
#: ``--unverified verify, the default; --unverified verify`` (a message that named both) said once.
_TWICE = re.compile(r"(--unverified (\w+))(, the default)?; --unverified \2\b")


def for_cli(text: str, target: str | None = None) -> str:
    """``text`` with its API phrases in flags and commands; ``target``: the patchset as the user typed it."""
    named = shlex.quote(target) if target else "PATCHSET"
    text = _POLICY.sub(lambda m: f"--unverified {m[2]}", text)
    text = _TWICE.sub(r"\1\3", text)
    text = text.replace("engine.verify(model) after apply, or ", "")  # the command beside it is the CLI's own
    text = text.replace("engine.apply(model, ..., verify=True): no tiny model",
                        f"patch-engine verify {named} --model FOLDER or --gguf FILE: your checkpoint, no tiny model")
    text = text.replace("(engine.apply(model): its own code measured",
                        "(patch-engine plan --model FOLDER --trust-remote-code, no patchset given: its own code measured")
    text = text.replace("loaded with trust_remote_code", "loaded with --trust-remote-code")
    return text.replace("load the model without trust_remote_code", "leave out --trust-remote-code")
