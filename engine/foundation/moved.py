"""Old module paths of the engine, kept importable after its modules moved into layer packages.

Why: a user's code may import ``engine.patcher`` or ``engine.routing``, and a model pickled before
the move names ``engine.bound_forward``, ``engine.planner`` and ``engine.report`` in its pickle.
Each old path in :data:`MOVED` imports as THE SAME module object as its new path (so
``isinstance``, monkeypatching and pickling by reference agree), with one
:class:`DeprecationWarning` per path and process saying where it moved. ``python -m
engine.matrix`` still runs the module too. ``engine/__init__.py`` installs the finder; nothing
here imports torch (``import engine`` stays torch-free).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import CodeType, ModuleType

__all__ = ["MOVED", "install", "message"]

#: Old module path -> where it lives now.
MOVED: dict[str, str] = {
    "engine.drift": "engine.foundation.drift",
    "engine.see_through": "engine.foundation.see_through",
    "engine.versions": "engine.foundation.versions",
    "engine.schema_common": "engine.schema.common",
    "engine.kernel_names": "engine.schema.kernel_names",
    "engine.devices": "engine.runtime.devices",
    "engine.wrappers": "engine.runtime.wrappers",
    "engine.placements": "engine.runtime.placements",
    "engine.routing": "engine.runtime.routing",
    "engine.hub_functions": "engine.runtime.hub_functions",
    "engine.submodels": "engine.runtime.submodels",
    "engine.release": "engine.runtime.release",
    "engine.tiny_config": "engine.tiny.config",
    "engine.planner": "engine.planning.planner",
    "engine.kernel_choice": "engine.planning.kernel_choice",
    "engine.fused_head": "engine.planning.fused_head",
    "engine.report": "engine.planning.report",
    "engine.patcher": "engine.patching.patcher",
    "engine.bound_forward": "engine.patching.bound_forward",
    "engine.forwards": "engine.patching.forwards",
    "engine.scaffolding_yaml": "engine.scaffolding.rendering",
    "engine.scaffold_capture": "engine.scaffolding.capture",
    "engine.scaffold_source": "engine.scaffolding.source",
    "engine.cli": "engine.commands.cli",
    "engine.bench": "engine.commands.bench",
    "engine.bench_checkpoint": "engine.commands.bench_checkpoint",
    "engine.demo": "engine.commands.demo",
    "engine.coverage": "engine.commands.coverage",
    "engine.matrix": "engine.commands.matrix",
    "engine.checkpoint": "engine.commands.checkpoint",
    "engine.results_sections": "engine.commands.results_sections",
}


def message(old: str) -> str:
    """What the DeprecationWarning of an old path says."""
    new = MOVED[old]
    return (f"{old} moved to {new}; import {new} (a model pickled before the move loads through this alias: "
            "save it again to refer to the new path)")


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new path (imported once, shared by both names)."""

    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(message(spec.name), DeprecationWarning, stacklevel=2)  # import frames are skipped
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system set ``__spec__`` to the alias's spec: give the module its own back.
        module.__spec__ = self.spec

    def get_code(self, fullname: str) -> CodeType | None:
        """``python -m engine.matrix``: runpy runs the new module's code as ``__main__``."""
        spec = importlib.util.find_spec(self.new)
        loader = spec.loader if spec is not None else None
        return loader.get_code(self.new) if isinstance(loader, importlib.abc.InspectLoader) else None


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds only the paths in :data:`MOVED`; every other import goes on to the next finder."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Alias(new))


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once per process, whatever reloads ``engine``)."""
    if not any(type(f).__name__ == _MovedFinder.__name__ and type(f).__module__ == __name__ for f in sys.meta_path):
        sys.meta_path.append(_MovedFinder())
