"""The identity of the code a class or function runs, read from the live objects in this process.

Why: a verdict ("this patch computes what the original computes") is about *code*, and a name,
a ``model_type``, a file's hash or a version string only stands for code: a class whose
``forward`` was rebound in a notebook, a same-named class of the user's, an edited transformers
install under the same version, a layer file edited between two processes all keep the name and
change the code. So every verdict and measurement is keyed by :func:`code_identity` of what it
patched, and bundled content covers only the identities CI recorded.

What it covers: for a class, its ``forward`` and ``__init__`` (``__init__`` decides what the
forward reads: ``weight`` or ``1 + weight``), every method or property the reached code names
on the class, and, from every reached function, the module-level functions, classes and
mappings of them (transformers' ``ACT2FN``) it names, down to the boundary of torch, the
standard library and the engine itself (the engine's own code is keyed by
:func:`engine.releases.key.engine_fingerprint`). Decorators are followed through ``__wrapped__``;
closures' simple values and defaults count.

How a function is identified: by its *source text* where the file on disk, compiled now, gives
exactly the live code object (so the identity does not depend on the Python version or the install
path: CI's 3.11 and a user's 3.13 agree on stock transformers); otherwise (a notebook cell,
``python -c``, a file edited after import, ``exec``) by its live bytecode, constants and names,
which no release's manifest holds, so such code is verified where it runs. Cheap: each code
object's digest and each file's compilation are memoized for the process.
"""

from __future__ import annotations

import builtins
import hashlib
import inspect
import linecache
import sys
import textwrap
import types
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from engine.foundation.see_through import see_through

__all__ = ["BOUNDARY", "MAX_REACHED", "code_identity", "identity_pieces", "own_class"]

#: Top-level packages whose code is not followed: it is the machinery a model's code runs on.
BOUNDARY = frozenset({"torch", "builtins", "numpy", "triton", "engine", "typing_extensions", "_pytest", "pytest",
                      *sys.stdlib_module_names})
#: At most this many functions and classes are followed from one root (a causal-LM class reaches transformers'
#: loss and generation machinery); beyond it the identity says so, still deterministic.
MAX_REACHED = 400

_SIMPLE = (int, float, bool, str, bytes, type(None))
#: transformers' machinery (decorators, masks, outputs, generation, loss dispatch): its functions are part of an
#: identity where a model's code names them, but what *they* call is not followed (a causal-LM class would otherwise
#: reach most of the library). Its modeling code (``transformers.models.*``) is followed as a user's is.
_LIBRARY = "transformers."
_MODELING = "transformers.models."
#: id(code) -> (code, digest): the code object is kept so its id is never reused.
_DIGESTS: dict[int, tuple[types.CodeType, str]] = {}
#: (filename, sha of its text) -> {(qualname, first line): code} of the file compiled now.
_FILES: dict[tuple[str, str], dict[tuple[str, int], types.CodeType]] = {}


def _outside(obj: Any) -> bool:
    """Whether ``obj`` belongs to the boundary (not followed); code with no module (exec'd from a string) is followed."""
    module = getattr(obj, "__module__", None) or ""
    if module == "builtins":  # a class exec'd where no __name__ was set says builtins too: only real ones are
        return getattr(builtins, getattr(obj, "__name__", ""), None) is obj
    return bool(module) and module.split(".")[0] in BOUNDARY


def _leaf(obj: Any) -> bool:
    """Whether ``obj`` is transformers' machinery: digested where named, its own calls not followed."""
    module = getattr(obj, "__module__", None) or ""
    return module.startswith(_LIBRARY) and not module.startswith(_MODELING)


def _module_like(cls: type) -> bool:
    """Whether a class has a ``forward`` of its own code (its ``__init__`` then decides what it computes)."""
    return any("forward" in vars(base) for base in cls.__mro__ if not _outside(base))


def _sha(text: str | bytes) -> str:
    return hashlib.sha256(text.encode() if isinstance(text, str) else text).hexdigest()


def _nested(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _nested(const)


def _compiled_file(filename: str) -> tuple[list[str], dict[tuple[str, int], types.CodeType]] | None:
    """The lines of ``filename`` as they are now and every code object compiling them gives, memoized."""
    if not filename.startswith("<"):
        linecache.checkcache(filename)
    lines = linecache.getlines(filename)
    if not lines:
        return None
    text = "".join(lines)
    key = (filename, _sha(text))
    if key not in _FILES:
        try:
            module = compile(text, filename, "exec", dont_inherit=True)
        except (SyntaxError, ValueError):
            _FILES[key] = {}
        else:
            _FILES[key] = {(c.co_qualname, c.co_firstlineno): c for c in _nested(module)}
    return lines, _FILES[key]


def _last_line(code: types.CodeType) -> int:
    return max((line for c in _nested(code) for _, _, line in c.co_lines() if line), default=code.co_firstlineno)


def _source(code: types.CodeType, *, checked: bool = True) -> str | None:
    """The source text of ``code`` where the file, compiled now, gives this very code object; else ``None``.

    ``checked=False`` (transformers' machinery, named but not followed): the lines the code object
    points at, without compiling the file to confirm them (modeling_utils.py alone costs ~0.15 s
    to compile); an edit made before import is still seen, one made after import is not.
    """
    if not checked:
        if not code.co_filename.startswith("<"):
            linecache.checkcache(code.co_filename)
        lines = linecache.getlines(code.co_filename)
        if len(lines) < _last_line(code):
            return None
        return textwrap.dedent("".join(lines[code.co_firstlineno - 1:_last_line(code)]))
    found = _compiled_file(code.co_filename)
    if found is None:
        return None
    lines, codes = found
    twin = codes.get((code.co_qualname, code.co_firstlineno))
    if twin is None or twin != code:  # edited after import, exec'd from a string, or another file of that name
        return None
    segment = "".join(lines[code.co_firstlineno - 1:_last_line(code)])
    return textwrap.dedent(segment)


def _constant(value: Any) -> str:
    if isinstance(value, types.CodeType):
        return "code:" + _normalized(value)
    if isinstance(value, (tuple, frozenset)):
        inner = sorted(map(_constant, value)) if isinstance(value, frozenset) else map(_constant, value)
        return f"{type(value).__name__}({','.join(inner)})"
    return f"{type(value).__name__}:{value!r}"


def _normalized(code: types.CodeType) -> str:
    """A digest of what ``code`` computes, without its file name or line numbers (same Python only)."""
    parts = [code.co_name, code.co_code.hex(), repr(code.co_names), repr(code.co_varnames), repr(code.co_freevars),
             repr(code.co_cellvars), f"{code.co_argcount},{code.co_posonlyargcount},{code.co_kwonlyargcount}",
             str(code.co_flags), ",".join(_constant(c) for c in code.co_consts)]
    return _sha("\n".join(parts))


def _code_digest(code: types.CodeType, *, checked: bool = True) -> str:
    held = _DIGESTS.get(id(code))
    if held is not None and held[0] is code:
        return held[1]
    source = _source(code, checked=checked)
    digest = ("src:" + _sha(source)) if source is not None else ("code:" + _normalized(code))
    _DIGESTS[id(code)] = (code, digest)
    return digest


def _value(value: Any) -> str:
    """A default's or closure cell's value: simple values by repr, others by their type (followed if code)."""
    if isinstance(value, _SIMPLE):
        return repr(value)
    if isinstance(value, (tuple, list)) and all(isinstance(v, _SIMPLE) for v in value):
        return repr(tuple(value))
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _function_piece(fn: types.FunctionType) -> str:
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(_value(cell.cell_contents))
        except ValueError:  # an empty cell
            cells.append("<empty>")
    extra = f"{_value(fn.__defaults__)}|{_value(sorted((fn.__kwdefaults__ or {}).items()))}|{','.join(cells)}"
    return _code_digest(fn.__code__, checked=not _leaf(fn)) + "|" + _sha(extra)[:16]


def _class_piece(cls: type) -> str:
    simple = sorted((k, _value(v)) for k, v in vars(cls).items()
                    if isinstance(v, _SIMPLE) and not k.startswith("__"))
    bases = [f"{b.__module__}.{b.__qualname__}" if _outside(b) else b.__qualname__ for b in cls.__bases__]
    return _sha(repr((bases, simple)))


def _class_attribute(cls: type, name: str) -> Any:
    """``name`` on ``cls`` as its own (or a non-boundary base's) ``__dict__`` holds it, else ``None``."""
    for owner in cls.__mro__:
        if name in vars(owner):
            return None if _outside(owner) else vars(owner)[name]
    return None


def _callables(value: Any) -> Iterator[Any]:
    """The functions behind a class attribute: a function, a property's accessors, a static or class method."""
    if isinstance(value, property):
        yield from (f for f in (value.fget, value.fset) if f is not None)
    elif isinstance(value, (staticmethod, classmethod)):
        yield value.__func__
    elif inspect.isfunction(value):
        yield value


def _names(fn: types.FunctionType) -> list[str]:
    return sorted({name for code in _nested(fn.__code__) for name in code.co_names})


class _Walk:
    """Breadth-first over what a root reaches; :attr:`pieces` maps a label to the digest of its code."""

    def __init__(self) -> None:
        self.pieces: dict[str, str] = {}
        self.queue: list[tuple[Any, type | None]] = []
        self.seen: set[int] = set()

    def add(self, obj: Any, owner: type | None = None) -> None:
        if id(obj) in self.seen or _outside(obj) and not isinstance(obj, (staticmethod, classmethod, property)):
            return
        self.seen.add(id(obj))
        self.queue.append((obj, owner))

    def run(self) -> dict[str, str]:
        while self.queue:
            if len(self.pieces) >= MAX_REACHED:
                self.pieces["<truncated>"] = str(MAX_REACHED)
                break
            obj, owner = self.queue.pop(0)
            if isinstance(obj, type):
                self._class(obj, root=not self.pieces)
            elif inspect.isfunction(obj):
                self._function(obj, owner)
        return self.pieces

    def _class(self, cls: type, *, root: bool) -> None:
        self.pieces[f"class {cls.__qualname__}"] = _class_piece(cls)
        # an output dataclass's or a config's generated __init__ computes nothing a patch replaces
        names = ("__init__", "forward", "__call__") if root or _module_like(cls) else ("forward", "__call__")
        for name in names:
            for fn in _callables(_class_attribute(cls, name)):
                self.add(fn, cls)

    def _function(self, fn: types.FunctionType, owner: type | None) -> None:
        self.pieces[f"def {fn.__qualname__}"] = _function_piece(fn)
        wrapped = getattr(fn, "__wrapped__", None)
        if inspect.isfunction(wrapped):
            self.add(wrapped, owner)
        for cell in fn.__closure__ or ():
            try:
                value = cell.cell_contents
            except ValueError:
                continue
            if inspect.isfunction(value) or isinstance(value, type):
                self.add(value, owner)
        if _leaf(fn):
            return
        names = _names(fn)
        namespace = fn.__globals__
        for name in names:
            if owner is not None:
                for method in _callables(_class_attribute(owner, name)):
                    self.add(method, owner)
            value = namespace.get(name)
            if value is None:
                continue
            value = _followable(value)
            if inspect.isfunction(value) or isinstance(value, type):
                self.add(value)
            elif isinstance(value, types.ModuleType) and not _outside(value):
                for attribute in names:  # module.function(...): the attribute names it takes
                    member = getattr(value, attribute, None)
                    if inspect.isfunction(member) or isinstance(member, type):
                        self.add(member)
            elif isinstance(value, Mapping) and not _outside(type(value)) or _is_registry(value):
                for item in list(value.values())[:64]:
                    item = item[0] if isinstance(item, tuple) and item else item  # ACT2FN: (class, kwargs)
                    if inspect.isfunction(item) or isinstance(item, type):
                        self.add(item)


def _followable(value: Any) -> Any:
    """The function behind our router or a ``kernels`` ``Func`` module (:func:`see_through`); else ``value``."""
    if inspect.isfunction(value) or isinstance(value, (type, types.ModuleType, Mapping)):
        return value
    inner = see_through(value)
    return inner if inspect.isfunction(inner) else value


def _is_registry(value: Any) -> bool:
    """A plain dict of functions or classes defined in a followed module (a dispatch table)."""
    return type(value) is dict and len(value) <= 256 and any(
        (inspect.isfunction(v) or isinstance(v, type)) and not _outside(v) for v in value.values())


def own_class(cls: type) -> type:
    """``cls``, or the class it wraps where torch made it at run time (FSDP2's ``FSDPQwen3RMSNorm``).

    Why: ``fully_shard`` swaps a module's class for a subclass made on the spot (its module is
    torch's); the code that computes is the wrapped class's, and that is what a verdict names.
    """
    if not _outside(cls):
        return cls
    return next((base for base in cls.__mro__[1:] if not _outside(base)), cls)


def identity_pieces(obj: type | Callable[..., Any]) -> dict[str, str]:
    """What :func:`code_identity` hashes: ``{"class Qwen3RMSNorm": digest, "def Qwen3RMSNorm.forward": ...}``."""
    walk = _Walk()
    obj = _followable(obj)
    walk.seen.add(id(obj))
    walk.queue.append((obj, None))
    return walk.run()


def code_identity(obj: type | Callable[..., Any]) -> str:
    """A 24-hex-digit identity of the code ``obj`` (a class or function) runs and reaches (see the module docstring).

    Example:
        >>> from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm   # doctest: +SKIP
        >>> code_identity(Qwen3RMSNorm)                                          # doctest: +SKIP
        '5f1c...'
    """
    pieces = identity_pieces(obj)
    return _sha(repr(sorted(pieces.items())))[:24]
