"""Importing a training stack's module on first use, or saying what went wrong: not installed, or broken.

Why one function: every integration imports its stack lazily (``import engine.integrations.x``
must not need the stack), and a failed import must read the same everywhere: our
:class:`~engine.errors.MissingDependency`, naming who needs it and the module. Two failures look
alike and need opposite answers:

* the stack (or the part of it we need) is not there: ``No module named 'llamafactory.v1'``. Then
  the pip line is the answer, with the version installed, if any (too old).
* the stack is there, and importing it failed somewhere inside: a dependency that does not load
  (a CUDA build of torchvision beside a CPU torch made LlamaFactory's ``from transformers import
  set_seed`` fail with ``Could not import module 'set_seed'``). Then "pip install llamafactory"
  would send the user to reinstall what is installed; the answer names the module whose import
  raised, the package it belongs to and the error at the bottom of the chain.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

from engine.errors import MissingDependency

__all__ = ["describe_import_failure", "import_stack_module"]


def import_stack_module(module: str, *, who: str, needs: str, install: str) -> Any:
    """``importlib.import_module(module)``, or :class:`MissingDependency` saying why it failed.

    Args:
        module: the stack's module to import (``"llamafactory.v1.launcher"``).
        who: what needs it (``"engine.integrations.twinkle"``).
        needs: what it needs (``"twinkle (the twinkle-kit package)"``).
        install: the pip line, given only where the stack (or that module of it) is not installed.

    Example:
        >>> import_stack_module("twinkle.patch.base", who="engine.integrations.twinkle", needs="twinkle",
        ...                     install='pip install "twinkle-kit==0.5.1"')  # doctest: +SKIP
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if _not_there(exc, module):
            installed = _installed_version(module.partition(".")[0])
            have = f"; installed: {installed}" if installed else ""
            raise MissingDependency(f"{who} needs {needs} ({module}{have}): {install} "
                                    f"({type(exc).__name__}: {exc})") from exc
        raise MissingDependency(f"{who}: {describe_import_failure(module, exc)}") from exc
    except Exception as exc:  # a package that raises while being imported (RuntimeError, OSError, ...)
        raise MissingDependency(f"{who}: {describe_import_failure(module, exc)}") from exc


def describe_import_failure(module: str, exc: BaseException) -> str:
    """Where importing ``module`` really failed: the module whose import raised, its package, the first error.

    ``importing llamafactory.v1.launcher failed in torchvision._meta_registrations (torchvision
    0.28.0): RuntimeError: operator torchvision::nms does not exist (reported as
    ModuleNotFoundError: Could not import module 'set_seed'...); llamafactory 0.9.5 is installed:
    the package named here is what to repair or remove``.
    """
    chain = _chain(exc)
    root = chain[-1]
    where = _failing_module(chain)
    if isinstance(root, ModuleNotFoundError) and root.name:  # a dependency that is not there at all
        by = f" (imported by {where}, {_package(where)})" if where else ""
        cause, fix = f"failed: module {root.name!r} is not installed{by}", "install the module named here"
    else:
        place = f"in {where} ({_package(where)})" if where else "(no module frame in the traceback)"
        cause, fix = f"failed {place}: {type(root).__name__}: {root}", "the package named here is what to repair or remove"
    reported = "" if root is exc else f" (reported as {type(exc).__name__}: {exc})"
    installed = _installed_version(module.partition(".")[0])
    return f"importing {module} {cause}{reported}" + (f"; {installed} is installed: {fix}" if installed else f"; {fix}")


def _not_there(exc: ImportError, module: str) -> bool:
    """The requested module, or a package above it, does not exist (not installed, or too old to have it)."""
    name = getattr(exc, "name", None)
    return isinstance(exc, ModuleNotFoundError) and bool(name) and (module == name or module.startswith(f"{name}."))


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from (``__cause__``, else an unsuppressed ``__context__``)."""
    chain, seen = [exc], {id(exc)}
    while True:
        last = chain[-1]
        nxt = last.__cause__ or (None if last.__suppress_context__ else last.__context__)
        if nxt is None or id(nxt) in seen:
            return chain
        chain.append(nxt)
        seen.add(id(nxt))


def _failing_module(chain: list[BaseException]) -> str | None:
    """The innermost module being imported (executing its body) when the first error of the chain was raised."""
    for exc in reversed(chain):  # the root's traceback first: it reaches deepest
        found = None
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_name == "<module>":
                found = tb.tb_frame.f_globals.get("__name__")
            tb = tb.tb_next
        if found:
            return str(found)
    return None


def _package(module: str) -> str:
    """The installed distribution (name and version) a module belongs to, or the module's top-level name."""
    top = module.partition(".")[0]
    return _installed_version(top) or f"top-level module {top}"


def _installed_version(top: str) -> str | None:
    """``"<distribution> <version>"`` of the installed distribution providing top-level module ``top``, or None."""
    for name in importlib.metadata.packages_distributions().get(top, []):
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return None
