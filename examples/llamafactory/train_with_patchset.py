"""Train with LlamaFactory (0.9.x) and a patch-engine patchset: ``llamafactory-cli train``, plus one key.

LlamaFactory's ``llamafactory-cli train config.yaml`` offers no way to add a ``TrainerCallback``
from the YAML, but its entry point does: ``llamafactory.train.tuner.run_exp(args, callbacks)``
hands ``callbacks`` to the ``Trainer`` of every stage (pt, sft, rm, ppo, dpo, kto). This
launcher reads the same YAML (and the same ``key=value`` overrides) as ``llamafactory-cli
train``, takes out this project's own keys, and calls ``run_exp`` with a
:class:`~engine.integrations.transformers.PatchsetCallback`. The callback patches the model
LlamaFactory built (after its LoRA wrapping, before the first step), so the YAML is otherwise
LlamaFactory's own, unchanged.

Our keys (taken out before LlamaFactory parses the rest, which refuses keys it does not know):

* ``patchset``: a bundled name (``qwen3``) or a path to a patchset YAML. Absent or ``null``: no
  patching at all, which is exactly ``llamafactory-cli train`` (the baseline).
* ``patchset_verify`` (default ``false``): compare every patched module with its original
  forward once when applying, and refuse to train on a mismatch.
* ``patchset_unverified`` (default: ``$PATCH_ENGINE_UNVERIFIED``, else ``verify``): what content not
  known verified on the installed transformers gets: ``verify`` it there first (verdict cached),
  ``refuse`` it, or ``trust`` it (with a warning). ``patchset_unverified_release`` is its old name.

Usage::

    python examples/llamafactory/train_with_patchset.py examples/llamafactory/qwen3_lora_sft_patched.yaml
    python examples/llamafactory/train_with_patchset.py CONFIG.yaml patchset=null      # unpatched
    torchrun --nproc_per_node 2 examples/llamafactory/train_with_patchset.py CONFIG.yaml  # several GPUs

(``llamafactory-cli train`` starts ``torchrun`` itself on a multi-GPU machine with its own
script, which would drop the callback; start ``torchrun`` on this file instead.)

What the run shows: when the trainer is built, the callback prints the report's one line
(``patch-engine: patchset 'qwen3' on qwen3 (cpu, training): 12 patched, ...``) on the main process,
and logs the full report at INFO under transformers' logger, which LlamaFactory shows by default
(it sets transformers' verbosity to INFO unless ``LLAMAFACTORY_VERBOSITY`` is WARN or above).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: This project's keys in a LlamaFactory YAML; everything else is LlamaFactory's.
OUR_KEYS = ("patchset", "patchset_verify", "patchset_unverified", "patchset_unverified_release")


def read_config(argv: Sequence[str]) -> dict[str, Any]:
    """The YAML file ``argv[0]`` merged with ``key=value`` overrides, as ``llamafactory-cli train`` reads them."""
    if not argv or not argv[0].endswith((".yaml", ".yml")):
        raise SystemExit(f"usage: {Path(__file__).name} CONFIG.yaml [key=value ...] (got {list(argv)})")
    from omegaconf import OmegaConf  # a LlamaFactory dependency

    merged = OmegaConf.merge(OmegaConf.load(Path(argv[0]).absolute()), OmegaConf.from_cli(list(argv[1:])))
    return OmegaConf.to_container(merged)


def patchset_callbacks(config: dict[str, Any]) -> list[Any]:
    """Take our keys out of ``config`` (in place) and return the callbacks they ask for.

    The patchset is loaded here, before LlamaFactory loads a model or a dataset, so that a
    misspelt name or a schema error stops the run in a second rather than after the load.
    """
    patchset = config.pop("patchset", None)
    verify = config.pop("patchset_verify", False)
    unverified, release = config.pop("patchset_unverified", None), config.pop("patchset_unverified_release", None)
    if not isinstance(verify, bool):
        raise SystemExit(f"patchset_verify is true or false, not {verify!r}")
    if patchset is None:
        return []
    from engine.integrations.transformers import PatchsetCallback
    from engine.loader import load_patchset

    return [PatchsetCallback(load_patchset(patchset), verify=verify, unverified=unverified, unverified_release=release)]


def main(argv: Sequence[str] | None = None, callbacks: Sequence[Any] = ()) -> list[Any]:
    """Run LlamaFactory on the config in ``argv`` with the patchset it names.

    Args:
        argv: ``[CONFIG.yaml, key=value, ...]``; ``sys.argv[1:]`` when ``None``.
        callbacks: further ``TrainerCallback``s to pass to LlamaFactory (e.g. a loss recorder).

    Returns:
        The patchset callbacks used (empty when the config names no patchset); each one's
        ``report`` says what was patched.
    """
    config = read_config(sys.argv[1:] if argv is None else argv)
    ours = patchset_callbacks(config)
    from llamafactory.train.tuner import run_exp

    run_exp(args=config, callbacks=[*ours, *callbacks])  # the callback prints its one line when it patches
    return ours


if __name__ == "__main__":
    main()
