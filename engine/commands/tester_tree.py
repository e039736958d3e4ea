"""transformers' test tree, importable on the installed transformers: its testers, found for a model type.

The tree (``../shared/hf-tests/transformers-tests.tar.gz``: transformers 5.15.1's ``tests/``) is
unpacked under ``.hf-suite/testers`` with the few packages its imports need beside the project's
[dev] extras (:func:`setup`), apart from the hf-suite's own copy (``tests/hf_suite``), whose
``src/transformers`` link points at 5.15.1: here it points at the installed release.

Why the 5.15.1 tree imports on a newer transformers: the testers are data (tiny sizes) and the
models are the installed release's own classes; what the newer release dropped from its test
helpers is put back where a test file imports it (:func:`_import`): a name the test tree imports
from transformers and the release lacks becomes a stub that raises if called (listed in
:data:`STUBBED`), and ``_TEXT_MODEL_TESTER_DEFAULTS``, plain data, is 5.15.1's own table. A package a
test file imports only for its integration tests (librosa) is stubbed where it is not installed.

:func:`find_tester` finds, for a model type, the test class that tests the type's generative class
(its image-text-to-text class, else its causal LM: the composite, not its language model), else a
tester whose config is the type's (or holds it as a sub-config: aria's ``text_config`` for ``aria_text``).
"""

from __future__ import annotations

import builtins
import importlib
import os
import sys
import types
import unittest
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["DEPS_DIR", "ROOT", "STUBBED", "TARBALL", "TESTS_DIR", "Found", "TesterDoesNotBuild", "find_tester",
           "install_import_shim", "reason", "setup", "test_files", "wanted_classes"]

ROOT = Path(__file__).resolve().parents[2]
WORK = Path(os.environ.get("COVERAGE_TESTERS_DIR", ROOT / ".hf-suite" / "testers"))
TARBALL = Path(os.environ.get("HF_SUITE_TARBALL", ROOT.parent / "shared" / "hf-tests" / "transformers-tests.tar.gz"))
TESTS_DIR = WORK / "transformers-tests"
DEPS_DIR = WORK / "deps"
#: What the test tree imports beside the project's [dev] extras (its README; httpx: tests/utils), and scipy,
#: which inkling's modeling code imports in its forward.
DEPS = ("parameterized", "timeout-decorator", "httpx", "httpcore", "scipy")
#: Packages a test file imports at its top for integration tests only, stubbed where absent: librosa (qwen2_5_omni,
#: qwen3_omni_moe: loading audio files), whose own dependencies (numba, soundfile) are not the testers' business, and
#: datasets, which every modeling test file reaches through the pipeline tests' mixin (tests/pipelines imports it to
#: load sample data): the README's install has no datasets (only trl pulls it in), and there every tester failed.
STUB_PACKAGES = ("librosa", "datasets")
#: transformers 5.15.1's ``testing_utils._TEXT_MODEL_TESTER_DEFAULTS`` (removed by a later release;
#: the 5.15.1 test tree's CausalLMModelTester and MultiModalModelTester read their sizes from it).
TEXT_MODEL_TESTER_DEFAULTS = {
    "batch_size": 13, "seq_length": 7, "is_training": True, "use_input_mask": True, "use_labels": True,
    "vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
    "intermediate_size": 32, "hidden_act": "gelu", "max_position_embeddings": 512, "pad_token_id": 0,
    "bos_token_id": 1, "eos_token_id": 2, "expert_interval": 1, "moe_layer_start_index": 0,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 36, "shared_expert_gate": True,
    "moe_num_shared_experts": 2, "num_experts_per_tok": 2, "num_experts": 8,
}
#: Names a test file imported from transformers that the installed release lacks (stubbed; see the docstring).
STUBBED: list[str] = []


class TesterDoesNotBuild(Exception):
    """The tester, its config, its model or the unpatched model's own run failed: without the engine."""


def setup() -> Path:
    """The test tree unpacked into :data:`TESTS_DIR` and its extra deps into :data:`DEPS_DIR` (each once)."""
    import subprocess
    import tarfile

    if not (TESTS_DIR / "tests").is_dir():
        WORK.mkdir(parents=True, exist_ok=True)
        with tarfile.open(TARBALL) as tar:
            tar.extractall(WORK, filter="data")
    link = TESTS_DIR / "src" / "transformers"  # some utilities read the package there (the tree's README)
    if not link.exists():
        import transformers

        link.parent.mkdir(exist_ok=True)
        link.symlink_to(Path(transformers.__file__).parent)
    done = DEPS_DIR / ".complete"
    if not done.exists() or done.read_text() != " ".join(DEPS):
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-q", "--no-deps", "--upgrade", "--target",
                        str(DEPS_DIR), *DEPS], check=True)
        done.write_text(" ".join(DEPS))
    return TESTS_DIR


class _Missing:
    """A name the installed transformers lacks, as a test file imports it: importable; calling it raises."""

    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import transformers

        raise NotImplementedError(f"{self._name} is not here (transformers {transformers.__version__}): a name the "
                                  "test tree imports, stubbed by engine.commands.tester_tree")

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._name}.{name}")


class _StubModule(types.ModuleType):
    """A package of :data:`STUB_PACKAGES` that is not installed: every name imports; calling one raises."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self.__name__}.{name}")


_STUBS: dict[str, types.ModuleType] = {}
_real_import = builtins.__import__


def _import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
    """``builtins.__import__``, which puts back what a test file imports from transformers and the release lacks."""
    caller = str((globals or {}).get("__file__") or "")
    if name in STUB_PACKAGES and not level and caller.startswith(str(TESTS_DIR)):
        try:
            return _real_import(name, globals, locals, fromlist, level)
        except ImportError:  # not in sys.modules: transformers' own availability checks still see it missing
            if name not in _STUBS:
                _STUBS[name] = _StubModule(name)
                STUBBED.append(name)
            return _STUBS[name]
    module = _real_import(name, globals, locals, fromlist, level)
    if not fromlist or level or not name.startswith("transformers") or not caller.startswith(str(TESTS_DIR)):
        return module
    for attr in fromlist:
        if attr == "*" or hasattr(module, attr):
            continue
        try:  # a submodule is imported, not stubbed
            importlib.import_module(f"{module.__name__}.{attr}")
            continue
        except ImportError:
            pass
        if module.__name__ == "transformers.testing_utils" and attr == "_TEXT_MODEL_TESTER_DEFAULTS":
            setattr(module, attr, dict(TEXT_MODEL_TESTER_DEFAULTS))
        else:
            setattr(module, attr, _Missing(f"{module.__name__}.{attr}"))
        STUBBED.append(f"{module.__name__}.{attr}")
    return module


def _test_cases(module: Any) -> list[type]:
    return [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, unittest.TestCase)
            and c.__module__ == module.__name__
            and (getattr(c, "all_model_classes", None) or getattr(c, "model_tester_class", None))]


def wanted_classes(model_type: str) -> list[str]:
    """The type's generative class names: image-text-to-text first (the composite), then causal LM."""
    from transformers.models.auto import modeling_auto

    tables = (modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES, modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    names = [t.get(model_type) for t in tables]
    return list(dict.fromkeys(n for n in names if isinstance(n, str)))


def test_files(model_type: str) -> list[Path]:
    """The type's test files: ``test_modeling_<folder>.py`` and ``test_modeling_<type>.py`` first, then the others."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    folder = model_type_to_module_name(model_type)
    where = TESTS_DIR / "tests" / "models" / folder
    first = [where / f"test_modeling_{name}.py" for name in (folder, model_type.replace("-", "_"))]
    return list(dict.fromkeys([p for p in first if p.is_file()] + sorted(where.glob("test_modeling_*.py"))))


@dataclass
class Found:
    """The test case (set up) whose tester builds the type's model, the class, and where the config comes from."""

    case: Any
    model_cls: type
    sub_config: str | None = None  # the tester's config holds the type's config under this name (aria's text_config)
    listed: bool = True  # the class is in the test's all_model_classes

    @property
    def test(self) -> str:
        owner = self.case if type(self.case) is not unittest.TestCase else self.case.model_tester
        where = f"{type(owner).__module__.split('.')[-1]}.{type(owner).__name__}"
        return where + (f" ({self.sub_config})" if self.sub_config else "") + ("" if self.listed else " (not listed)")


def _unused_testers(module: Any, cases: list[Any]) -> list[Any]:
    """A bare test case holding each ``*ModelTester`` of ``module`` that no test class uses (inkling's text tester)."""
    used = {type(c.model_tester) for c in cases}
    found = []
    for name, cls in vars(module).items():
        if not (isinstance(cls, type) and name.endswith("ModelTester") and cls.__module__ == module.__name__):
            continue
        if cls in used:
            continue
        case = unittest.TestCase()
        try:
            case.model_tester = cls(case)
        except Exception:  # noqa: BLE001, S112  (a tester that takes other arguments is not one to guess)
            continue
        found.append(case)
    return found


def _sub_config(config: Any, model_type: str) -> str | None:
    """The name under which ``config`` holds a sub-config of ``model_type`` (``text_config``), else None."""
    for name in getattr(type(config), "sub_configs", None) or {}:
        if getattr(getattr(config, name, None), "model_type", None) == model_type:
            return str(name)
    return None


def find_tester(model_type: str) -> Found:
    """The test class that tests the type's generative class; else a tester of its config (or of a sub-config)."""
    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    files, wanted = test_files(model_type), wanted_classes(model_type)
    if not files:
        folder = model_type_to_module_name(model_type)
        raise TesterDoesNotBuild(f"no test file tests/models/{folder}/test_modeling_*.py in the test tree (5.15.1's)")
    errors, others = [], []
    for path in files:
        try:
            module = importlib.import_module(".".join(path.relative_to(TESTS_DIR).with_suffix("").parts))
        except Exception as exc:  # noqa: BLE001  (the file's imports drifted further than the stubs reach)
            errors.append(f"{path.name} does not import: {reason(exc)}")
            continue
        for case_cls in _test_cases(module):
            try:
                case = case_cls()
                case.setUp()
            except Exception as exc:  # noqa: BLE001  (another test class of the file may be the one)
                errors.append(f"{case_cls.__name__}.setUp: {reason(exc)}")
                continue
            tested = {c.__name__ for c in (getattr(case, "all_model_classes", None) or ())}
            for cls_name in wanted:
                if cls_name in tested:
                    return Found(case, getattr(transformers, cls_name))
            if getattr(case, "model_tester", None) is not None:
                others.append(case)
        others += _unused_testers(module, others)
    configs = []  # the type's config (else a sub-config of it) from a tester that lists no such class
    for case in others if wanted else ():
        try:
            configs.append((case, case.model_tester.prepare_config_and_inputs_for_common()[0]))
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{type(case.model_tester).__name__}: {reason(exc)}")
    for case, config in configs:
        if getattr(config, "model_type", None) == model_type:
            return Found(case, getattr(transformers, wanted[0]), listed=False)
    for case, config in configs:
        sub = _sub_config(config, model_type)
        if sub is not None:
            return Found(case, getattr(transformers, wanted[0]), sub, listed=False)
    names = ", ".join(p.name for p in files)
    if not errors and not others:
        raise TesterDoesNotBuild(f"{names}: no ModelTester (integration tests only)")
    raise TesterDoesNotBuild("; ".join(errors) or f"no tester of {names} tests {' or '.join(wanted) or '-'} "
                             "or builds its config")


def reason(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def install_import_shim() -> None:
    """Test files import what this transformers lacks as stubs (:func:`_import`): for the sweep's worker only."""
    builtins.__import__ = _import
