"""The import structure of ``engine/``: layers, rules, no cycles, and validation without torch.

This file is the source of the rules: :data:`LAYERS` and :data:`RULES` below are data, and
``docs/architecture.md`` renders the same tables (``test_the_docs_show_these_tables`` fails
with the text to paste when they differ). Imports are read with :mod:`ast`, so nothing is
imported to check them:

* every ``import`` / ``from ... import`` counts, at module level or inside a function; one under
  ``if TYPE_CHECKING:`` (annotations only, never run) counts for cycles only;
* layer rules and :data:`RULES` apply to every import, wherever it is written: a deferred
  import still couples the two modules;
* cycles are judged on every import too, annotations included (a function-level or type-only
  cycle is a knot even where it does not break at import time: put the types in the lower
  module and the rendering above it), except a module importing its own package: the registry
  importing ``engine.kernels`` to load the bundled providers on first use. (On the tree
  before issue 10 this finds schema <-> kernels.registry and patcher <-> verify.)
"""

from __future__ import annotations

import ast
import fnmatch
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "engine"

#: Third-party packages a torch-free layer must not import: they cost seconds to import.
HEAVY = ("torch", "transformers")


@dataclass(frozen=True)
class Layer:
    name: str
    modules: tuple[str, ...]  # fnmatch patterns of module names
    torch_free: bool
    job: str


#: Lowest first. A module may import modules of its own layer and of the layers above it in
#: this list, never of a layer below it.
LAYERS: tuple[Layer, ...] = (
    Layer("foundation", ("engine.errors", "engine.foundation", "engine.foundation.*"), True,
          "error types; installed versions, signature drift, the function behind a router or a `kernels` "
          "wrapper, and where a moved module went (its old path still imports)"),
    Layer("vocabulary", ("engine.schema", "engine.schema.*"), True,
          "pydantic models of what a patchset may say, their shared bases, the table of kernel names"),
    Layer("loading", ("engine.loader", "engine.loader.*"), True,
          "YAML with line numbers, extends, messages, names, JSON Schema"),
    Layer("runtime", ("engine.runtime", "engine.runtime.*"), False,
          "torch helpers: devices, wrapper unwrapping, DTensor placements, function routing (traced by dynamo), "
          "hub functions, sub-models, the version refusal (is a patchset for this transformers)"),
    Layer("tiny models", ("engine.tiny", "engine.tiny.*"), False,
          "a tiny perturbed model of a family, and its config (verification's probes, the scaffold, tests)"),
    Layer("ops", ("engine.ops", "engine.ops.*"), False,
          "semantics: target contract, binding, the torch reference (Op.reference)"),
    Layer("kernels", ("engine.kernels", "engine.kernels.*"), False,
          "providers: registry, torch references as the `torch` provider, vendor kernels, and the shims that run "
          "vendor Triton kernels under Triton's interpreter (triton_interpret/)"),
    Layer("planning", ("engine.planning", "engine.planning.*"), False,
          "decisions (their types, kernel choice, the fused_cross_entropy switch), and how they are shown"),
    Layer("patching", ("engine.patching", "engine.patching.*"), False,
          "apply a plan to one model, all-or-nothing; revert; the installed (picklable) forwards, beneath wrappers"),
    Layer("verification", ("engine.verification", "engine.verification.*"), False,
          "patched vs original numbers: probes, comparisons, report"),
    Layer("release verification", ("engine.releases", "engine.releases.*"), False,
          "content not known verified on the installed release (a user's patchset, an edited bundled one, a release "
          "outside its range): verified there on a tiny model of the user's type before patching, the verdict cached "
          "on disk; the manifest of bundled content CI verified (key, cache, manifest, verdict, which way an apply "
          "goes, self-verification, the gate apply runs)"),
    Layer("scaffolding", ("engine.scaffolding", "engine.scaffolding.*"), False,
          "the scaffold: every declaration measured on a tiny model, written as a patchset (its capture, its "
          "model from a checkpoint folder)"),
    Layer("zero configuration", ("engine.zeroconfig", "engine.zeroconfig.*"), False,
          "engine.apply(model) with no patchset: the bundled file of its type, else the scaffold's declarations "
          "measured on a tiny copy of its own config and classes, verified there (verdict cached), with its report"),
    Layer("facade", ("engine", "engine.api"), False, "engine.apply / plan / verify / revert: plan, patch, verify"),
    Layer("integrations", ("engine.integrations", "engine.integrations.*"), False,
          "the Trainer callback and the training stacks' plugins"),
    Layer("auditing", ("engine.auditing", "engine.auditing.*"), False,
          "the verifier on someone else's patch: the original measured before the patch, what the patch changed in "
          "the model and the process (restored after), each change judged and explained, the stacks' adapters"),
    Layer("commands", ("engine.commands", "engine.commands.*", "engine.__main__"), False,
          "the command line and each command: benchmarks (a real checkpoint too, and their shared results file), "
          "demo, coverage, the version matrix, verification on a user's checkpoint"),
)


@dataclass(frozen=True)
class Rule:
    importers: tuple[str, ...]  # fnmatch patterns of the modules the rule is about
    forbidden: tuple[str, ...]  # fnmatch patterns of what they must not import (engine modules or packages)
    why: str


#: The rules of issue 10, named one by one (the layer order implies most of them; naming them
#: keeps them if the layers are ever reshuffled).
RULES: tuple[Rule, ...] = (
    Rule(("engine.schema", "engine.schema.*", "engine.loader", "engine.loader.*"),
         ("torch", "transformers", "engine.ops*", "engine.kernels*", "engine.planning*", "engine.patching*"),
         "validating a patchset must not import torch (a pre-commit hook, a CI schema job)"),
    Rule(("engine", "engine.errors", "engine.schema.kernel_names"), ("torch", "transformers"),
         "`import engine` and every error type stay torch-free"),
    Rule(("engine.ops", "engine.ops.*"), ("engine.kernels*",),
         "an op defines semantics; engine/kernels/torch_reference.py makes its reference a provider"),
    Rule(("engine.kernels", "engine.kernels.*"), ("engine.planning*", "engine.patching*", "engine.verification*"),
         "providers know nothing of plans, patching or verification"),
    Rule(("engine.patching", "engine.patching.*"), ("engine.verification*", "engine.api"),
         "the patcher knows nothing of verification: engine.api orchestrates plan, patch, verify"),
    Rule(("engine*",), ("engine.commands.cli",), "nothing in the core imports the command line (only engine.__main__)"),
)

#: Modules exempt from a rule that matches them by pattern.
RULE_EXEMPT = {"engine.__main__": {"engine.commands.cli"}}

#: The guide says "no module over ~400 lines"; this is where the test draws the line.
MAX_LINES = 450


# --------------------------------------------------------------------------------------
# Reading imports


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module (an engine module, or a third-party top-level package)
    line: int
    type_only: bool = False  # under ``if TYPE_CHECKING:``: counts for cycles only

    @property
    def where(self) -> str:
        return f"{module_file(self.source).relative_to(ROOT)}:{self.line}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_files() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if "_bundled" not in p.parts}


def module_file(name: str) -> Path:
    return module_files()[name]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _Collector(ast.NodeVisitor):
    """Every import of one module, at any depth (functions included); those under TYPE_CHECKING marked."""

    def __init__(self, source: str, is_package: bool, known: set[str]):
        self.source, self.is_package, self.known = source, is_package, known
        self.found: list[Import] = []
        self.type_only = False

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self.type_only = True
            for child in node.body:
                self.visit(child)
            self.type_only = False
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def add(self, target: str, node: ast.stmt) -> None:
        if not target.startswith("engine"):
            target = target.split(".")[0]
        self.found.append(Import(self.source, target, node.lineno, self.type_only))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self.add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            package = self.source if self.is_package else self.source.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{base}" if base else package
        for alias in node.names:
            candidate = f"{base}.{alias.name}"
            self.add(candidate if candidate in self.known else base, node)


def all_imports(*, type_only: bool = False) -> list[Import]:
    """Every import that runs; with ``type_only=True`` those under ``if TYPE_CHECKING:`` too."""
    files = module_files()
    found: list[Import] = []
    for name, path in files.items():
        collector = _Collector(name, path.name == "__init__.py", set(files))
        collector.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        found.extend(imp for imp in collector.found if type_only or not imp.type_only)
    return found


def layer_of(module: str) -> int:
    matches = [i for i, layer in enumerate(LAYERS) if any(fnmatch.fnmatchcase(module, p) for p in layer.modules)]
    assert len(matches) == 1, f"{module} is in {len(matches)} layers; add it to exactly one of LAYERS"
    return matches[0]


# --------------------------------------------------------------------------------------
# The rules


def test_every_module_is_in_exactly_one_layer() -> None:
    problems = []
    for module in module_files():
        matches = [layer.name for layer in LAYERS if any(fnmatch.fnmatchcase(module, p) for p in layer.modules)]
        if len(matches) != 1:
            problems.append(f"{module}: in {matches or 'no layer'}")
    assert not problems, "place every module of engine/ in one layer of LAYERS (and docs/architecture.md):\n" + (
        "\n".join(problems)
    )


def test_no_module_imports_a_higher_layer() -> None:
    engine_modules = set(module_files())
    problems = []
    for imp in all_imports():
        if imp.target in engine_modules and layer_of(imp.target) > layer_of(imp.source):
            problems.append(
                f"{imp.where}: {imp.source} ({LAYERS[layer_of(imp.source)].name}) imports {imp.target} "
                f"({LAYERS[layer_of(imp.target)].name})"
            )
    assert not problems, "imports against the layer order (docs/architecture.md):\n" + "\n".join(problems)


def test_torch_free_layers_import_neither_torch_nor_transformers() -> None:
    problems = [
        f"{imp.where}: {imp.source} imports {imp.target}"
        for imp in all_imports()
        if imp.target in HEAVY and LAYERS[layer_of(imp.source)].torch_free
    ]
    assert not problems, "torch-free layers must stay torch-free:\n" + "\n".join(problems)


def test_the_rules_of_issue_10_hold() -> None:
    problems = []
    for imp in all_imports():
        for rule in RULES:
            if not any(fnmatch.fnmatchcase(imp.source, p) for p in rule.importers):
                continue
            if imp.target in RULE_EXEMPT.get(imp.source, ()):
                continue
            if any(fnmatch.fnmatchcase(imp.target, p) for p in rule.forbidden):
                problems.append(f"{imp.where}: {imp.source} imports {imp.target}: {rule.why}")
    assert not problems, "\n".join(problems)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (or a self-import), as a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def _import_graph() -> dict[str, set[str]]:
    """Edges between engine modules; a module importing its own package is not an edge.

    Why that exception: ``engine.ops.base.get_op`` imports ``engine.ops`` (and the registry
    ``engine.kernels``) to load the bundled ops (providers) on first use; the package's
    ``__init__`` imports its modules, the module is already loaded by then, and nothing breaks.
    """
    engine_modules = set(module_files())
    edges: dict[str, set[str]] = {}
    for imp in all_imports(type_only=True):
        if imp.target not in engine_modules:
            continue
        if imp.source.startswith(imp.target + "."):
            continue
        edges.setdefault(imp.source, set()).add(imp.target)
    return edges


def test_no_import_cycles() -> None:
    cycles = _cycles(_import_graph())
    assert not cycles, f"import cycles (module-level, function-level or type-only imports): {cycles}"


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_a_type_only_import_counts_for_cycles_but_not_for_layers() -> None:
    collector = _Collector("engine.a", False, {"engine.a", "engine.b"})
    collector.visit(ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from engine.b import X\n"))
    assert [(i.target, i.type_only) for i in collector.found] == [("typing", False), ("engine.b", True)]


def test_no_module_is_too_long() -> None:
    lines = {m: len(p.read_text(encoding="utf-8").splitlines()) for m, p in module_files().items()}
    long = {m: n for m, n in lines.items() if n > MAX_LINES}
    assert not long, f"split these modules by job (at most ~400 lines): {long}"


def test_no_submodule_shadows_a_facade_name() -> None:
    """``import engine.verify`` would replace the function ``engine.verify`` with a module."""
    import engine

    submodules = {m.split(".")[1] for m in module_files() if m.count(".") >= 1}
    assert not submodules & set(engine._LAZY), submodules & set(engine._LAZY)


def test_the_table_of_kernel_names_is_the_bundled_providers() -> None:
    from engine.kernels import registry
    from engine.schema import kernel_names

    bundled = {p.name for p in registry.all_providers() if getattr(p.build, "__module__", "").startswith("engine.")}
    assert bundled == kernel_names.BUNDLED


def test_every_op_has_its_reference_as_the_torch_provider() -> None:
    from engine.kernels import registry
    from engine.ops import all_ops

    for name, op in all_ops().items():
        provider = registry.get("torch", name)
        assert provider.build == op.reference and provider.description == op.reference_description


# --------------------------------------------------------------------------------------
# The documentation


def render_tables() -> str:
    """The tables of docs/architecture.md, as this file defines them."""
    lines = ["| # | layer | modules | imports torch | job |", "|---|---|---|---|---|"]
    for i, layer in enumerate(LAYERS):
        modules = ", ".join(f"`{m}`" for m in layer.modules)
        lines.append(f"| {i} | {layer.name} | {modules} | {'never' if layer.torch_free else 'may'} | {layer.job} |")
    lines += ["", "| modules | must not import | why |", "|---|---|---|"]
    for rule in RULES:
        who = ", ".join(f"`{m}`" for m in rule.importers)
        what = ", ".join(f"`{m}`" for m in rule.forbidden)
        lines.append(f"| {who} | {what} | {rule.why} |")
    return "\n".join(lines) + "\n"


def test_the_docs_show_these_tables() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert render_tables() in doc, (
        "docs/architecture.md must show the tables of tests/test_architecture.py; paste:\n\n" + render_tables()
    )


# --------------------------------------------------------------------------------------
# Validation without torch

#: Run before the code under test: torch and transformers cannot be imported at all.
_NO_TORCH = """
import sys

class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} is blocked: this process must not need it")
        return None

sys.meta_path.insert(0, _NoTorch())
"""


def _run_without_torch(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", _NO_TORCH + code, *args],
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_blocker_really_blocks_torch() -> None:
    done = _run_without_torch("import torch")
    assert done.returncode != 0 and "torch is blocked" in done.stderr


def test_validate_needs_neither_torch_nor_transformers() -> None:
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "patchsets").glob("*.yaml"))
    code = """
import runpy
sys.argv = ["patch-engine", "validate", *sys.argv[1:]]
try:
    runpy.run_module("engine", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
else:
    code = 0
assert "torch" not in sys.modules and "transformers" not in sys.modules, "imported torch"
sys.exit(code)
"""
    done = _run_without_torch(code, *files)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count(": ok (") == len(files) > 0, done.stdout


def test_load_patchset_and_errors_need_neither_torch_nor_transformers(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        "name: bad\nmodel_types: [qwen3]\npatches:\n  - target: Qwen3MLP\n    op: swiglu\n    kernel: nosuch\n"
    )
    code = """
import engine
from engine.loader import bundled_names, json_schema_text

for name in bundled_names():
    assert engine.load_patchset(name).name
assert isinstance(engine.Patchset, type) and json_schema_text().startswith("{")
try:
    engine.load_patchset(sys.argv[1])
except engine.PatchsetError as exc:
    assert "bad.yaml:6: patches[0].kernel: unknown kernel 'nosuch'" in str(exc), str(exc)
else:
    raise AssertionError("no error")
assert "torch" not in sys.modules and "transformers" not in sys.modules
print("ok", len(bundled_names()))
"""
    done = _run_without_torch(code, str(bad))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok ") and int(done.stdout.split()[1]) > 0


@pytest.mark.parametrize("command", [["schema"], ["validate", "--json", "patchsets/qwen3.yaml"]])
def test_other_schema_commands_need_no_torch(command: list[str]) -> None:
    code = """
import runpy
sys.argv = ["patch-engine", *sys.argv[1:]]
try:
    runpy.run_module("engine", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    sys.exit(exc.code)
"""
    done = _run_without_torch(code, *command)
    assert done.returncode == 0, done.stderr
    assert done.stdout.lstrip().startswith("{")
