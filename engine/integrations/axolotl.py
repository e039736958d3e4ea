"""Train with a patchset under axolotl: a plugin line and a key in the YAML you already have.

::

    plugins:
      - engine.integrations.axolotl.PatchsetPlugin
    patchset: qwen3                    # a bundled name or a path; absent or `auto`: zero configuration
                                       # (the bundled file of the model's type, else measured and verified)
    patchset_verify: true              # or "sample"; default false
    patchset_fused_cross_entropy: true # or {kernel: ..., chunk_size: ...}; absent: the patchset's key
    patchset_unverified: verify        # or refuse, trust: content not known verified on this transformers
                                       # (patchset_unverified_release: its old name)

and ``axolotl train config.yaml`` as usual. Why a plugin, the way axolotl's own Liger plugin
is one: axolotl loads every class listed under ``plugins:`` before it validates the config,
and merges the pydantic model each returns from ``get_input_args`` into its own config schema.
So our keys are checked by axolotl's validation with everything else: a wrong type, an unknown
patchset name or a misspelt ``patchset_*`` key stops ``axolotl train`` before the model loads.

Why ``post_model_load`` and not Liger's ``pre_model_load``: Liger swaps classes in the modeling
module before the model is built; the engine patches a built model, in place, and axolotl calls
``post_model_load`` once the model is loaded *and* its adapters (LoRA) are attached, before the
trainer is made (so before accelerate wraps it for FSDP/DDP and before any compile), which is
the order the engine needs (docs/training.md). A ``PeftModel`` is patched as the transformers
model inside it. The plan is always for training; the device is the model's.

What ``axolotl train`` shows: the report's one line at INFO from the logger
``axolotl.integrations.patch_engine``. Why that name: axolotl's logging config
(``axolotl.logging_config``) prints the ``axolotl`` namespace at INFO on stdout and drops every
other logger below WARNING, so a logger of ours outside it would be silent unless the user set
``LOG_LEVEL=INFO``. Made with axolotl's ``get_logger``, it logs on the main process only, and the
full report at DEBUG reaches axolotl's debug log in the output folder (``output_dir/debug.log``)
and the console with ``AXOLOTL_LOG_LEVEL=DEBUG``.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import BaseModel, field_validator, model_validator
from torch import nn

from engine.api import apply, plan
from engine.errors import PatchError, TrainerConflict
from engine.integrations.announce import announce
from engine.integrations.stack_import import import_stack_module
from engine.integrations.unverified import unverified_setting
from engine.planning.report import Report
from engine.runtime.wrappers import unwrap
from engine.schema import FusedCrossEntropy

_AXOLOTL = {"who": "engine.integrations.axolotl (an axolotl plugin)", "needs": "axolotl",
            "install": "pip install axolotl (0.21.0 tested; it declares Python >= 3.12)"}
BasePlugin = import_stack_module("axolotl.integrations.base", **_AXOLOTL).BasePlugin

__all__ = ["PatchsetArgs", "PatchsetPlugin"]

#: In axolotl's namespace, so that axolotl's logging shows it at its default level (module docstring).
LOG = import_stack_module("axolotl.utils.logging", **_AXOLOTL).get_logger("axolotl.integrations.patch_engine")

#: The key prefix of this plugin's settings in an axolotl YAML.
PREFIX = "patchset"


class PatchsetArgs(BaseModel):
    """This plugin's keys in an axolotl config (merged into axolotl's own schema by axolotl)."""

    patchset: str | None = None
    patchset_verify: bool | Literal["sample"] = False
    patchset_fused_cross_entropy: bool | FusedCrossEntropy | None = None
    #: What content not known verified on the installed transformers gets (engine.apply's
    #: ``unverified``); absent: ``$PATCH_ENGINE_UNVERIFIED``, else ``verify``.
    patchset_unverified: Literal["verify", "refuse", "trust"] | None = None
    #: ``patchset_unverified``'s old name.
    patchset_unverified_release: Literal["verify", "refuse", "trust"] | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_misspelt_keys(cls, data: Any) -> Any:
        """A ``patchset_*`` key that is not ours is a typo: refuse it (axolotl would keep it silently)."""
        if isinstance(data, dict):
            ours = set(PatchsetArgs.model_fields)  # not cls's: axolotl merges this model into its ~400-key schema
            for key in data:
                if isinstance(key, str) and key.startswith(PREFIX) and key not in ours:
                    near = difflib.get_close_matches(key, sorted(ours), n=1)
                    hint = f"; did you mean {near[0]!r}?" if near else ""
                    raise ValueError(f"unknown key {key!r} for engine.integrations.axolotl.PatchsetPlugin "
                                     f"(its keys: {', '.join(sorted(ours))}){hint}")
        return data

    @field_validator("patchset")
    @classmethod
    def _loads(cls, value: str | None) -> str | None:
        """Load the patchset now, so a misspelt name or a schema error stops before the model loads."""
        from engine.zeroconfig import is_zero_config

        if not is_zero_config(value):  # auto / measure: zero configuration, measured when the model is loaded
            from engine.loader import load_patchset

            try:
                load_patchset(value)
            except PatchError as exc:
                raise ValueError(f"patchset: {exc}") from exc
        return value


class PatchsetPlugin(BasePlugin):
    """An axolotl plugin that patches the loaded (and adapter-wrapped) model with a patchset.

    Attributes:
        report: the :class:`~engine.planning.report.Report` of the last apply (``None`` before).
    """

    def __init__(self) -> None:
        super().__init__()
        self.report: Report | None = None

    def get_input_args(self) -> str:
        return f"{__name__}.PatchsetArgs"

    def register(self, cfg: Any) -> None:
        """Before validation: keep axolotl from auto-enabling its LoRA kernels under a patchset.

        For a LoRA/QLoRA config that sets none of ``lora_mlp_kernel``, ``lora_qkv_kernel``,
        ``lora_o_kernel``, axolotl turns all three on; the MLP one replaces each MLP's instance
        forward with its own Triton function, which the engine cannot patch beneath (it refuses
        with ``ForwardWrapped``). Setting the MLP flag to ``false`` stops the auto-enabling (any
        set flag does); set ``lora_qkv_kernel``/``lora_o_kernel: true`` to keep those two.
        A config that sets ``lora_mlp_kernel: true`` itself is left as written (and refused).
        """
        if not isinstance(cfg, dict) or cfg.get("adapter") not in ("lora", "qlora"):
            return
        if all(cfg.get(flag) is None for flag in ("lora_mlp_kernel", "lora_qkv_kernel", "lora_o_kernel")):
            cfg["lora_mlp_kernel"] = False
            LOG.warning("patch-engine: lora_mlp_kernel set to false (axolotl's LoRA MLP kernel replaces the MLP "
                        "forward the patchset patches); axolotl's other LoRA kernels stay off unless set true")

    def post_model_load(self, cfg: Any, model: nn.Module) -> None:
        """Patch ``model`` for training; a refusal (or a failed verification) stops axolotl before step 1."""
        patchset = _setting(cfg, "patchset")  # None / "auto": zero configuration (engine.zeroconfig)
        fused = _setting(cfg, "patchset_fused_cross_entropy")
        release = unverified_setting(_setting(cfg, "patchset_unverified"), _setting(cfg, "patchset_unverified_release"),
                                     where="axolotl config",
                                     keys=("patchset_unverified", "patchset_unverified_release"))
        _refuse_fused_head_under_trl(cfg, model, patchset, fused, release)
        self.report = apply(model, patchset, mode="training", verify=_setting(cfg, "patchset_verify") or False,
                            fused_cross_entropy=fused, unverified_release=release)
        announce(self.report, line=LOG.info, detail=LOG.debug)


def _refuse_fused_head_under_trl(cfg: Any, model: nn.Module, patchset: str | None, fused: Any, release: str | None) -> None:
    """``rl:`` runs TRL's trainers, which compute the head themselves (see :mod:`engine.ops.trl_head`)."""
    rl = _setting(cfg, "rl")
    if not rl:
        return
    from engine.zeroconfig import resolve

    patchset = resolve(unwrap(model), patchset, mode="training", fused_cross_entropy=fused)
    if patchset is None:  # zero configuration found nothing to patch: no head either
        return
    the_plan = plan(unwrap(model), patchset, mode="training", fused_cross_entropy=fused, unverified_release=release)
    if any(d.op == "fused_linear_cross_entropy" for d in the_plan.patched):
        raise TrainerConflict(f"patchset {the_plan.patchset.name!r} with a fused head under `rl: {rl}`: axolotl trains "
                              "with TRL's trainer, which computes the causal-LM head itself; set "
                              "patchset_fused_cross_entropy: false")


def _setting(cfg: Any, key: str) -> Any:
    """``cfg[key]`` from axolotl's ``DictDefault`` (or any mapping / object), ``None`` when absent."""
    if isinstance(cfg, dict):
        return cfg.get(key)
    return getattr(cfg, key, None)
