"""LlamaFactory v1 (``USE_V1=1``): a ``patch_engine`` kernel plugin, and a launcher that registers it.

LlamaFactory's v1 API chooses kernels by name from the YAML (``kernel_config: {name: ...}``):
``ModelEngine._init_model`` (``llamafactory/v1/core/model_engine.py``) calls
``KernelPlugin(name)(model=..., include_kernels=...)`` once the model is built and its PEFT
adapters are attached, the place where Liger's plugin (``name: liger_kernel``) patches it too.
This module registers a plugin under the name ``patch_engine``, so the user's YAML says::

    kernel_config:
      name: patch_engine
      patchset: qwen3          # optional: a bundled name or a path; absent or `auto`: zero configuration
                               # (the bundled file of the model's type, else measured and verified)
      verify: true             # optional (default false): check each patched module once, before step 1
      unverified: verify       # optional: verify (default), refuse or trust content not known verified on
                               # this transformers (engine.apply's unverified; unverified_release: its old name)

v1 never imports user code, so the plugin must be registered before LlamaFactory reads the
YAML: ``python -m engine.integrations.llamafactory sft cfg.yaml`` does that, then runs
LlamaFactory's own v1 entry point on the same argv (the verbs of ``llamafactory-cli`` under
``USE_V1=1``: ``sft``/``train``, ``rm``, ``dpo``, ``chat``, ``merge``, ``help``).

Why the launcher reads the settings itself: ``ModelEngine`` passes a kernel plugin only
``model`` and ``include_kernels``; the rest of ``kernel_config`` (``patchset``, ``verify``)
never reaches it. The launcher therefore parses the argv with v1's own ``get_args`` first (the
parse ``run_sft`` repeats; it seeds the same RNG with the same seed, so nothing changes), checks
our keys and loads the patchset, so a misspelt name stops the run before a model is loaded.

Why the fused head stays off: v1's trainers read ``outputs.logits`` every step
(``BaseTrainer.compute_log_probs``) and the fused head returns none in training, as LlamaFactory
itself turns Liger's fused cross entropy off for training (``require_logits``). A
``fused_cross_entropy: true`` in ``kernel_config`` is refused; a patchset that declares it is
applied without it.

What the run shows: the report's one line at INFO from the logger
``llamafactory.v1.plugins.patch_engine``, made with v1's ``get_logger``: in the ``llamafactory.v1``
namespace it goes through LlamaFactory's own stdout handler, at its default level (INFO,
``LLAMAFACTORY_VERBOSITY``), and on the main process only; the full report at DEBUG
(``LLAMAFACTORY_VERBOSITY=DEBUG``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from engine.errors import InvalidArgument, MissingDependency, TrainerConflict
from engine.integrations.announce import announce
from engine.integrations.stack_import import import_stack_module

__all__ = ["PLUGIN_NAME", "Settings", "apply_patchset", "configure", "main", "register", "run"]

#: The name users write in ``kernel_config: {name: ...}``.
PLUGIN_NAME = "patch_engine"
#: Keys of ``kernel_config`` this plugin reads (``name`` and ``include_kernels`` are LlamaFactory's).
OUR_KEYS = ("patchset", "verify", "fused_cross_entropy", "unverified", "unverified_release")
#: LlamaFactory v1's training verbs (``launcher._DIST_TRAIN_COMMANDS``): the model is patched for training.
TRAIN_VERBS = ("train", "sft", "dpo", "rm")
#: Verbs that build a model (through ``ModelEngine``); the others go straight to LlamaFactory's launcher.
MODEL_VERBS = (*TRAIN_VERBS, "chat", "merge")
INSTALL = 'pip install "llamafactory==0.9.5"'
#: Our logger, in LlamaFactory v1's namespace: its handler and level show it (module docstring).
LOGGER = "llamafactory.v1.plugins.patch_engine"


@dataclass(frozen=True)
class Settings:
    """What the plugin applies, read from ``kernel_config`` by :func:`configure`."""

    patchset: Any  # a loaded Patchset, or None / "auto" / "measure": zero configuration (engine.zeroconfig)
    verify: bool
    mode: str  # "training" or "inference"
    unverified_release: str | None = None  # engine.apply's policy; None: the environment's, else verify


_settings: Settings | None = None
#: The report of the last apply by the plugin (``None`` before), for callers and tests.
last_report: Any = None


def _import(module: str) -> Any:
    """Import a LlamaFactory v1 module, or say what to install (or, installed, what failed to import)."""
    return import_stack_module(module, who="the LlamaFactory v1 integration",
                               needs="LlamaFactory 0.9.5 or later (its v1 API)", install=INSTALL)


def configure(kernel_config: Mapping[str, Any] | None, *, training: bool) -> Settings | None:
    """Check ``kernel_config`` and remember what the plugin will apply; ``None`` if it names another plugin.

    Raises :class:`InvalidArgument` for a key this plugin does not read or a value it does not
    take, :class:`TrainerConflict` for ``fused_cross_entropy: true``, and the loader's
    ``PatchsetError`` for a patchset that does not load, all before any model is built.
    """
    global _settings
    if kernel_config is None or kernel_config.get("name") != PLUGIN_NAME:
        _settings = None
        return None
    where = f"kernel_config (name: {PLUGIN_NAME})"
    unknown = sorted(set(kernel_config) - {"name", "include_kernels", *OUR_KEYS})
    if unknown:
        raise InvalidArgument(f"{where}: unknown key(s) {unknown}; it reads {list(OUR_KEYS)} (and `include_kernels: auto`)")
    include = kernel_config.get("include_kernels")
    if include not in (None, True, "auto"):
        raise InvalidArgument(
            f"{where}: include_kernels: {include!r} is not supported: a patchset is applied whole; "
            "leave include_kernels out (or `auto`), and write a patchset that `extends:` another to choose patches"
        )
    verify = kernel_config.get("verify", False)
    if not isinstance(verify, bool):
        raise InvalidArgument(f"{where}: verify is true or false, not {verify!r}")
    if kernel_config.get("fused_cross_entropy") not in (None, False):
        raise TrainerConflict(
            f"{where}: fused_cross_entropy cannot run under LlamaFactory v1: its trainers compute the loss from "
            "outputs.logits (BaseTrainer.compute_log_probs), which the fused head does not return in training "
            "(LlamaFactory turns Liger's fused cross entropy off for the same reason); remove the key"
        )
    from engine.integrations.unverified import unverified_setting
    from engine.loader import load_patchset

    release = unverified_setting(kernel_config.get("unverified"), kernel_config.get("unverified_release"), where=where,
                                 keys=("unverified", "unverified_release"))
    name = kernel_config.get("patchset")
    from engine.zeroconfig import is_zero_config

    patchset = name if is_zero_config(name) else load_patchset(name)  # None/auto/measure: zero configuration
    _settings = Settings(patchset=patchset, verify=verify, mode="training" if training else "inference",
                         unverified_release=release)
    return _settings


def apply_patchset(model: Any, include_kernels: Any = None, **kwargs: Any) -> Any:
    """The ``patch_engine`` kernel plugin: what ``ModelEngine`` calls after attaching adapters.

    Applies the configured patchset (by default zero configuration: the bundled one of the model's
    ``model_type``, else declarations measured and verified on a tiny copy) and returns the
    model, as LlamaFactory's kernel plugins do.
    """
    global last_report
    from engine.api import apply

    if _settings is None:
        raise InvalidArgument(
            f"the {PLUGIN_NAME!r} kernel plugin was called without its settings: LlamaFactory passes a kernel plugin "
            "only include_kernels, so start training with `python -m engine.integrations.llamafactory sft CONFIG.yaml` "
            "(or engine.integrations.llamafactory.run), which reads patchset/verify from kernel_config"
        )
    last_report = apply(model, _settings.patchset, mode=_settings.mode, verify=_settings.verify, fused_cross_entropy=False,
                        unverified_release=_settings.unverified_release)
    logger = _import("llamafactory.v1.utils.logging").get_logger(LOGGER)
    announce(last_report, line=logger.info, detail=logger.debug)
    return model


def register() -> None:
    """Register :func:`apply_patchset` as LlamaFactory v1's kernel plugin ``patch_engine`` (once)."""
    interface = _import("llamafactory.v1.plugins.model_plugins.kernels.interface")
    plugin = interface.KernelPlugin(PLUGIN_NAME)
    if plugin._registry.get(PLUGIN_NAME, {}).get("__call__") is not apply_patchset:
        plugin.register()(apply_patchset)


def _configure_from_argv(verb: str) -> Settings | None:
    """Parse ``sys.argv`` with v1's own ``get_args`` (what ``run_sft`` does next) and configure the plugin."""
    model_args, *_ = _import("llamafactory.v1.config.arg_parser").get_args()
    return configure(model_args.kernel_config, training=verb in TRAIN_VERBS)


def _torchrun_args(verb: str, rest: Sequence[str]) -> list[str] | None:
    """The ``torchrun`` command LlamaFactory's ``launch()`` would start, on this module; ``None`` for one process.

    LlamaFactory starts ``torchrun`` on its own ``launcher.py``, which would never register the
    plugin; the same command on ``-m engine.integrations.llamafactory`` does (each rank registers).
    """
    env = _import("llamafactory.v1.utils.env")
    helper = _import("llamafactory.v1.accelerator.helper")
    if verb not in TRAIN_VERBS or "LOCAL_RANK" in os.environ:  # one process, or already a torchrun worker
        return None
    if not (env.is_env_enabled("FORCE_TORCHRUN") or (helper.get_device_count() > 1 and not env.use_ray()
                                                     and not env.use_kt())):
        return None
    nnodes, addr = os.getenv("NNODES", "1"), os.getenv("MASTER_ADDR", "127.0.0.1")
    port = os.getenv("MASTER_PORT", str(env.find_available_port()))
    args = ["torchrun", "--nproc-per-node", os.getenv("NPROC_PER_NODE", str(helper.get_device_count()))]
    if os.getenv("RDZV_ID") is not None:
        low, high = os.getenv("MIN_NNODES"), os.getenv("MAX_NNODES")
        args += ["--nnodes", f"{low}:{high}" if low is not None and high is not None else nnodes,
                 "--rdzv-id", os.environ["RDZV_ID"], "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{addr}:{port}",
                 "--max-restarts", os.getenv("MAX_RESTARTS", "0")]
    else:
        args += ["--nnodes", nnodes, "--node_rank", os.getenv("NODE_RANK", "0"),
                 "--master_addr", addr, "--master_port", port]
    return [*args, "-m", __name__ if __name__ != "__main__" else "engine.integrations.llamafactory", verb, *rest]


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m engine.integrations.llamafactory VERB CONFIG.yaml [key=value ...]``: LlamaFactory v1, plus the plugin."""
    argv = list(sys.argv[1:] if argv is None else argv)
    verb = argv.pop(0) if argv else "help"
    launcher = _import("llamafactory.v1.launcher")
    saved = sys.argv
    try:
        if verb in MODEL_VERBS:
            command = _torchrun_args(verb, argv)
            if command is not None:
                raise SystemExit(subprocess.run(command, check=False).returncode)
            sys.argv = [saved[0], *argv]  # what v1's get_args reads
            _configure_from_argv(verb)
            register()
        sys.argv = [saved[0], verb, *argv]
        if verb in TRAIN_VERBS:
            launcher.main()  # what LlamaFactory runs in each process (its launch() minus the torchrun start)
        else:
            launcher.launch()  # chat, merge, help, ...: LlamaFactory's own handling
    finally:
        sys.argv = saved


def run(verb: str, args: Mapping[str, Any]) -> Settings | None:
    """From Python: configure and register the plugin from ``args`` (a v1 config dict), then run ``verb``.

    ``run("sft", {...})`` is ``run_sft(args)`` with the plugin; ``rm`` likewise. Returns the settings used.
    """
    if verb not in ("sft", "train", "rm"):
        raise InvalidArgument(f"run({verb!r}, ...): one of 'sft', 'train', 'rm'; other verbs through main()")
    model_args, *_ = _import("llamafactory.v1.config.arg_parser").get_args(dict(args))
    settings = configure(model_args.kernel_config, training=True)
    register()
    if verb == "rm":
        _import("llamafactory.v1.trainers.rm_trainer").run_rm(dict(args))
    else:
        _import("llamafactory.v1.trainers.sft_trainer").run_sft(dict(args))
    return settings


if __name__ == "__main__":
    try:
        main()
    except MissingDependency as exc:  # one line saying what to install, not a traceback
        raise SystemExit(f"{type(exc).__name__}: {exc}") from None
