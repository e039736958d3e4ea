"""``--with llamafactory-v1``: LlamaFactory v1's kernel plugins, ``kernel_config: {name: auto, include_kernels: auto}``.

What its model engine runs for that config: ``KernelPlugin("auto")(model=model, include_kernels="auto")``,
which applies every kernel its registry holds. The registry is filled when the kernel modules are
imported, with the kernels whose device is the current accelerator's, and each kernel checks the
device again before patching: on an NPU they are ``npu_fused_rmsnorm`` (every class named
``*RMSNorm*``: ``1 + weight`` for a hard-coded set of three classes, the weight for any other),
``npu_fused_swiglu`` (``npu_swiglu`` on ~25 named MLP classes, Gemma 2/3/3n's gelu-tanh MLPs
among them), ``npu_fused_rope`` (the rope function of every attention's modeling module) and
``npu_fused_moe``. Here the accelerator is an NPU for LlamaFactory (its ``get_current_accelerator``
answers ``npu``) and ``torch_npu`` is the emulator of its documented ops
(:mod:`engine.kernels.npu_emulation`); the report says so.

LlamaFactory 0.9.5 pins transformers<=5.6, so it lives in its own venv (docs/audit.md). Its
kernel modules must be imported under this emulation to register their NPU kernels: run the audit
in a process that has not imported them yet (the command line does).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path

from torch import nn

from engine.auditing.adapters import Adapter
from engine.auditing.adapters.stack_data import stack_data
from engine.errors import MissingDependency
from engine.foundation.versions import installed_version

__all__ = ["claims", "for_model_type"]

_ROOT = "llamafactory.v1"
_KERNELS = f"{_ROOT}.plugins.model_plugins.kernels"


def claims() -> list[str]:
    """The model types of the MLP classes its SwiGLU kernel names (its norm and rope kernels match any model).

    Read from its source, not imported: importing a kernel module off an NPU registers nothing, and a
    later import under the emulated NPU would then find it imported and its registry empty.
    """
    named = _swiglu_classes()
    table = stack_data("llamafactory-v1")["swiglu_classes"]
    return sorted(t for t, classes in table.items() if not named or named & set(classes))


def _swiglu_classes() -> set[str]:
    """``NpuSwiGluKernel.expect_modules`` of the installed LlamaFactory, from its file (empty if not installed)."""
    import ast

    spec = importlib.util.find_spec("llamafactory")
    if spec is None or not spec.submodule_search_locations:
        return set()
    path = Path(spec.submodule_search_locations[0], *_KERNELS.split(".")[1:], "ops", "mlp", "npu_swiglu.py")
    if not path.is_file():
        return set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "expect_modules" for t in node.targets):
            return {c.value for c in ast.walk(node.value) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return set()


def for_model_type(model_type: str) -> Adapter:
    try:
        importlib.import_module(f"{_ROOT}.accelerator.helper")
    except ImportError as exc:
        raise MissingDependency(f"--with llamafactory-v1 needs LlamaFactory (0.9.5 pins transformers<=5.6: its own venv): "
                                f"{exc}") from exc

    def apply(model: nn.Module) -> None:
        interface = importlib.import_module(f"{_KERNELS}.interface")
        if not interface.default_kernels:
            raise RuntimeError("LlamaFactory's kernel registry is empty: its kernel modules were imported before the "
                               "emulated NPU (run the audit in a fresh process)")
        interface.KernelPlugin("auto")(model=model, include_kernels="auto")

    return Adapter(f"llamafactory {installed_version('llamafactory')} v1: KernelPlugin('auto'), include_kernels: auto",
                   apply, environment=_on_an_npu, notes=[_NOTE], reading="the torch_npu emulator")


_NOTE = ("the accelerator is an NPU for LlamaFactory (its get_current_accelerator answers npu, so its NPU kernels "
         "register and apply), and torch_npu is the emulator of its documented ops (engine/kernels/npu_emulation.py: "
         "each op computes in fp32 and rounds once, an assumption: the documentation gives formulas, not rounding); "
         "an op it does not emulate is unchecked")


@contextlib.contextmanager
def _on_an_npu(model: nn.Module) -> Iterator[None]:
    """LlamaFactory's accelerator is an NPU and ``torch_npu`` the emulator, for its imports, its apply and the runs."""
    from engine.kernels.npu_emulation import emulated_torch_npu

    helper = importlib.import_module(f"{_ROOT}.accelerator.helper")
    real = helper.get_current_accelerator
    npu = types.SimpleNamespace(type=helper.DeviceType.NPU.value)

    def fake(check_available: bool = True) -> types.SimpleNamespace:
        return npu

    def holders(value: object) -> list[types.ModuleType]:  # modules that bound the name (``from ... import``)
        return [m for n, m in list(sys.modules.items())
                if n.startswith(_ROOT) and getattr(m, "get_current_accelerator", None) is value]

    with emulated_torch_npu():
        for holder in holders(real):
            holder.get_current_accelerator = fake
        try:
            yield
        finally:
            for holder in holders(fake):  # also those first imported inside the block
                holder.get_current_accelerator = real
