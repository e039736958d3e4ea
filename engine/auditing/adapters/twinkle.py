"""``--with twinkle``: twinkle-kit's ``kernelize(model)``, its ``DEFAULT_KERNEL_CONFIG``, as its users get it.

``kernelize`` walks its default map: for each target it picks the first available backend
(``npu``, then ``liger``) and installs it by class replacement (``module.__class__``), by
``setattr`` on a class's ``forward`` or a modeling module's function (for the whole process), or
by a custom installer (its NPU attention writes ``ALL_ATTENTION_FUNCTIONS["sdpa"]``). Here the
platform is an NPU: twinkle's own ``NPU`` platform answers ``Platform.get_platform`` and
``torch_npu`` is the emulator of its documented ops (:mod:`engine.kernels.npu_emulation`); where
liger-kernel is importable its Triton fallbacks run under Triton's interpreter. The report says
both, and lists the map's entries that name nothing in the installed transformers (they patch
nothing, silently, in twinkle).

twinkle-kit pins peft<=0.19 and numpy<2.3, so it lives in its own venv; run this there with
``PYTHONPATH`` pointing at this checkout (docs/audit.md).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Iterator
from typing import Any

from torch import nn

from engine.auditing.adapters import Adapter, NotClaimed
from engine.auditing.adapters.stack_data import model_types_of_modules, stack_data
from engine.errors import MissingDependency
from engine.foundation.versions import installed_version

__all__ = ["claims", "for_model_type", "unresolved_targets"]


def _config() -> dict[Any, Any]:
    try:
        from twinkle.kernel import DEFAULT_KERNEL_CONFIG
    except ImportError as exc:
        raise MissingDependency("--with twinkle needs twinkle-kit (its own venv: it pins peft<=0.19, numpy<2.3): "
                                f"{exc}") from exc
    return dict(DEFAULT_KERNEL_CONFIG)


def _modules(config: dict[Any, Any]) -> set[str]:
    return {str(t).split(".modeling_")[0] + ".modeling_" + str(t).split(".modeling_")[1].split(".")[0]
            for t in config if isinstance(t, str) and ".modeling_" in t}


def claims() -> list[str]:
    """The model types of the modeling modules its default map names (twinkle's own map, or our record of it)."""
    if importlib.util.find_spec("twinkle") is None:
        return list(stack_data("twinkle")["claims"])
    return model_types_of_modules(_modules(_config()))


def unresolved_targets(config: dict[Any, Any]) -> list[str]:
    """Targets of the map that resolve to nothing in the installed transformers (kernelize skips them at DEBUG)."""
    missing = []
    for target in config:
        if not isinstance(target, str) or not target.startswith("transformers."):
            continue
        module, _, rest = target.partition(".modeling_")
        module_name = f"{module}.modeling_{rest.split('.')[0]}"
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError:
            missing.append(target)
            continue
        for attr in rest.split(".")[1:]:
            obj = getattr(obj, attr, None)
            if obj is None:
                missing.append(target)
                break
    return missing


def for_model_type(model_type: str) -> Adapter:
    config = _config()
    claimed = claims()
    if model_type not in claimed:
        raise NotClaimed(f"twinkle {installed_version('twinkle-kit')}'s DEFAULT_KERNEL_CONFIG names no modeling module "
                         f"of model type {model_type!r} (it names {', '.join(claimed)})")
    notes = [_NPU_NOTE]
    if importlib.util.find_spec("liger_kernel") is not None:
        notes.append(_LIGER_NOTE)

    def apply(model: nn.Module) -> None:
        from twinkle.kernel import kernelize

        kernelize(model)
        missing = unresolved_targets(config)
        if missing:
            notes.append(f"{len(missing)} of the map's {len(config)} entries name nothing in transformers "
                         f"{installed_version()} and patch nothing (silently): {', '.join(sorted(missing))}")

    return Adapter(f"twinkle {installed_version('twinkle-kit')}: kernelize(model) (DEFAULT_KERNEL_CONFIG)", apply,
                   environment=_on_an_npu, notes=notes, reading="the torch_npu emulator")


_NPU_NOTE = ("the platform is an NPU: twinkle's own NPU platform answers Platform.get_platform, and torch_npu is the "
             "emulator of its documented ops (engine/kernels/npu_emulation.py: each op computes in fp32 and rounds once, "
             "an assumption: the documentation gives formulas, not rounding); an op it does not emulate is unchecked")
_LIGER_NOTE = ("liger-kernel is importable: twinkle's liger fallbacks are Triton kernels, run on this CPU under "
               "Triton's interpreter with the engine's shims")


@contextlib.contextmanager
def _on_an_npu(model: nn.Module) -> Iterator[None]:
    """twinkle sees an NPU (its ``NPU`` platform, the emulated ``torch_npu``); Triton kernels are interpreted."""
    from twinkle.utils.platforms.base import Platform
    from twinkle.utils.platforms.npu import NPU

    from engine.kernels.npu_emulation import emulated_torch_npu

    real = Platform.__dict__["get_platform"]
    with contextlib.ExitStack() as stack:
        stack.enter_context(emulated_torch_npu())
        if importlib.util.find_spec("liger_kernel") is not None and importlib.util.find_spec("triton") is not None:
            from engine.kernels.triton_interpret import interpreting

            stack.enter_context(interpreting())
        Platform.get_platform = staticmethod(lambda platform=None: NPU if platform in (None, "NPU") else  # type: ignore[method-assign]
                                             real.__func__(platform))
        try:
            yield
        finally:
            Platform.get_platform = real  # type: ignore[method-assign]
