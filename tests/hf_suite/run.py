"""Run transformers' own modeling tests unpatched and patched, compare them test by test, write docs/hf_tests.md.

Usage (from the repository root, inside the project's venv)::

    python tests/hf_suite/run.py setup                      # transformers 5.15.1 + its tests under .hf-suite/
    python tests/hf_suite/run.py sweep [FAMILY ...]         # every family (default) x every mode, then the page
    python tests/hf_suite/run.py sweep qwen3 --modes off,torch
    python tests/hf_suite/run.py ci                         # the CI subset (.ci/hf-suite); exit 1 on a difference
    python tests/hf_suite/run.py collect                    # the summary and page from the results at hand
    python tests/hf_suite/run.py render                     # docs/hf_tests.md again from the committed summary

Why a subprocess per file and mode: the mode is process-wide (the compiled kernels' switch and
threshold, Triton's interpreter), and transformers' tests leave state behind them. Why
transformers 5.15.1: the test tree at hand (``/work/shared/hf-tests``) is that release's, and other
releases' modeling code differs from its tests. It is installed into a ``--target`` folder put
first on ``PYTHONPATH`` (as ``.ci/matrix`` does), so the venv's torch, liger and fla are shared.

Each run writes ``<results>/<family>-<mode>.json`` (every test's outcome, the models built,
patched and refused) and its log; a sweep resumes where it stopped (``--again`` reruns). The summary
(``benchmarks/results/hf_tests/summary.json``, one row per family and mode) is what the page is
rendered from. Run it niced on a shared machine: ``nice -n 19 python tests/hf_suite/run.py ...``.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
WORK = Path(os.environ.get("HF_SUITE_DIR", ROOT / ".hf-suite"))
TARBALL = Path(os.environ.get("HF_SUITE_TARBALL", ROOT.parent / "shared" / "hf-tests" / "transformers-tests.tar.gz"))
RELEASE = "5.15.1"
TF_DIR = WORK / f"tf-{RELEASE}"
TESTS_DIR = WORK / "transformers-tests"
RESULTS = WORK / "results"
SUMMARY = ROOT / "benchmarks" / "results" / "hf_tests"
PAGE = ROOT / "docs" / "hf_tests.md"
#: What the tests need beside the project's [dev] extras (the tree's README), installed into TF_DIR.
TEST_DEPS = ("parameterized", "timeout-decorator", "pytest-timeout")
MODES = ("off", "torch", "compiled", "interpret")
#: Per test, pytest-timeout's limit: a hung test fails instead of stopping the sweep.
TIMEOUT_S = 600

#: The interpret mode runs one test per tester class in the sweep: the retained gradients of hidden
#: states, a forward and a backward of the base model (the liger and fla kernels' backward is where a
#: CUDA plan differs most from the torch one), hidden states and attentions kept with ``retain_grad``.
#: Interpreted, each Triton program runs in Python: qwen3's ``test_training`` (the same kernels under
#: each head class) took 92 s, each gradient-checkpointing variant 120 s, on 2 busy cores; the whole file
#: would take hours, and its forwards are what the other modes run. qwen3 ran more (training and the
#: non-reentrant checkpointing, ``INTERPRET_MORE``), and the CI subset trains qwen3 with the fused head.
INTERPRET_SELECTION = "test_retain_grad_hidden_states_attentions"
INTERPRET_MORE = ("test_training and not test_training_overfit and not test_training_gradient_checkpointing"
                  " or test_training_gradient_checkpointing_use_reentrant_false"
                  " or test_retain_grad_hidden_states_attentions")
#: The sweep's torch mode, and the unpatched run every mode of a family is compared with: the whole file but
#: two groups of tests that are most of its time and test no kernel a family has that the rest of the file
#: does not. ``test_fsdp2_*`` spawn two processes per test (mistral: 6 tests, 71 of the file's 133 s), to
#: shard the same patched modules the rest of the file runs; ``test_generate_compilation_all_outputs``
#: compiles generate (mistral: 45 s) where ``test_generate_compile_model_forward_fullgraph`` (kept, 4 s)
#: compiles the patched forward with ``fullgraph``. Both ran in whole-file runs (llama, qwen3, gemma3,
#: qwen3_moe, mistral: llama-like, 1 + w norms with geglu, and experts), and ``--whole`` runs them anywhere.
SWEEP_SELECTION = "not test_fsdp2 and not test_generate_compilation_all_outputs"
#: The compiled mode runs, with the compiled kernels forced on every call, the tests where compiled code
#: meets autograd and torch's own machinery: training (a backward through the compiled kernels), every
#: gradient-checkpointing variant (torch stops a non-reentrant recompute early by raising through the
#: kernel: the bug this mode found), retained gradients of hidden states (``retain_graph``), and the
#: experts' implementation switches. The rest of a file is forwards at new shapes: each compiles anew (a
#: few seconds a kernel, for every dtype and padding variant), and its forwards are what the torch mode
#: runs, the patched forward inside a ``fullgraph`` compile too.
COMPILED_SELECTION = ("test_training and not test_training_overfit or test_retain_grad_hidden_states_attentions"
                      " or test_eager_matches_batched_and_grouped_inference")
SELECTIONS = {"off": SWEEP_SELECTION, "torch": SWEEP_SELECTION, "compiled": COMPILED_SELECTION,
              "interpret": INTERPRET_SELECTION}


@dataclass(frozen=True)
class Run:
    """One pytest run: a family's test file in a mode, optionally a -k selection and another patchset."""

    family: str
    mode: str
    selection: str = ""
    patchset: str | None = None  # a bundled patchset instead of the model type's own (qwen3_flce)

    @property
    def name(self) -> str:
        """The results file's name: the whole file where the mode has a selection adds ``-all``; a selection
        other than the mode's own adds a hash of it."""
        suffix = ""
        if self.selection != SELECTIONS.get(self.mode, ""):
            suffix = f"-k{hashlib.sha1(self.selection.encode()).hexdigest()[:8]}" if self.selection else "-all"
        return f"{self.family}-{self.mode}" + (f"-{self.patchset}" if self.patchset else "") + suffix


#: Packages hidden from a family's runs (but in ``interpret`` mode, whose CUDA plan needs them). Why fla
#: for the GatedDeltaNet families: transformers 5.15.1 wraps ``torch_chunk_gated_delta_rule`` in a
#: fallback that imports fla whenever it is installed, GPU or not (``use_kernel_func_from_hub_with_
#: fallback``), so on this CPU every forward, unpatched too, ran fla's Triton kernel and failed ("0 active
#: drivers"). Hidden, the layer calls the torch function, as it does on a CPU under 5.17 and later.
#: olmo_hybrid's GatedDeltaNet layers have the same fallback (79 of its tests failed that way both ways
#: before it was listed here).
HIDDEN: dict[str, tuple[str, ...]] = {"qwen3_next": ("fla",), "qwen3_5": ("fla",), "qwen3_5_moe": ("fla",),
                                     "olmo_hybrid": ("fla",)}


#: Packages stubbed for a family's runs: an import its test module needs that this machine cannot install.
#: gemma4: 5.15.1's ``image_processing_gemma4`` imports ``torchvision.transforms.v2.functional`` unguarded,
#: and the test module imports the processor, so without torchvision nothing is collected; the offline
#: index has only CUDA builds of torchvision for torch 2.13 (they need ``libtorch_cuda``). Every module
#: and name of the stub imports, and calling anything of it raises (only image processing would: the
#: modeling tests that process images are the slow, skipped integration tests; a test that did would
#: fail the same way unpatched).
STUBBED: dict[str, tuple[str, ...]] = {"gemma4": ("torchvision",)}

_STUB = '''"""A stub made by the hf-suite (tests/hf_suite/run.py, STUBBED): every submodule and name imports; a call raises."""

import importlib.abc
import importlib.machinery
import sys
import types


class _Missing:
    def __init__(self, name):
        self._name = name

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self._name}.{name}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: a stub of the hf-suite ({__name__} is not installable here)")

    def __mro_entries__(self, bases):
        return (object,)


class _Module(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self.__name__}.{name}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


__version__ = "0.0.0"
sys.meta_path.insert(0, _Finder())
sys.modules[__name__].__class__ = _Module
'''


def _stubbing(packages: tuple[str, ...]) -> Path:
    """A folder where each of ``packages`` imports as a stub (put first on the path)."""
    folder = WORK / ("stubs-" + "-".join(packages))
    for package in packages:
        (folder / package).mkdir(parents=True, exist_ok=True)
        (folder / package / "__init__.py").write_text(_STUB)  # its ``__name__`` is the package's
    return folder


def _hiding(packages: tuple[str, ...]) -> Path:
    """A folder whose packages of these names fail to import (put first on the path)."""
    folder = WORK / ("hidden-" + "-".join(packages))
    for name in packages:
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "__init__.py").write_text(f'raise ImportError("{name} is hidden by the hf-suite")\n')
    return folder


#: The CI subset (``.ci/hf-suite``): every op and kernel provider at least once, not only llama-like
#: families, within 15 minutes on 2 cores. Each family also gets one unpatched run of the union of
#: its selections. Why these: qwen3 is the llama-like baseline (rms_norm, swiglu, rope; its forward
#: under a fullgraph compile, cached generation, save and load; liger's kernels interpreted; the
#: fused head with qwen3_flce, trained on labels); gemma3 brings geglu, 1 + w norms, the vision
#: tower's layer_norm, and the gradient-checkpointing tests the compiled kernels once broke;
#: qwen3_moe the experts and their experts_implementation switches (once ignored); qwen3_next
#: gated_rms_norm and linear attention (decode too), fla hidden (``HIDDEN``); gpt_neox the ungated ``mlp``
#: (fc, GELU, fc, with biases), its biased LayerNorm and partial rotary (``rotary_pct``). fla's own kernels are not
#: in this subset: under 5.15.1 a model of its families calls fla itself whenever fla is importable, so
#: the unpatched baseline cannot run here; .ci/interpret runs them through the engine instead.
_TRAIN = "test_training and not test_training_overfit and not test_training_gradient_checkpointing"
_RETAIN = "test_retain_grad_hidden_states_attentions"
CI_RUNS: tuple[Run, ...] = (
    Run("qwen3", "torch", f"{_TRAIN} or {_RETAIN} or test_generate_continue_from_past_key_values"
                          " or test_generate_compile_model_forward_fullgraph or test_save_load"),
    Run("qwen3", "compiled", f"test_training_gradient_checkpointing or {_RETAIN}"),
    Run("qwen3", "torch", _TRAIN, patchset="qwen3_flce"),
    Run("qwen3", "interpret", _TRAIN, patchset="qwen3_flce"),
    Run("gemma3", "compiled", "gradient_checkpointing"),
    Run("gemma3", "interpret", f"Gemma3TextModelTest and {_RETAIN}"),
    Run("qwen3_moe", "torch", f"test_eager_matches_batched_and_grouped_inference"
                              f" or {_TRAIN}"),
    Run("qwen3_next", "torch", f"{_TRAIN} or {_RETAIN} or test_generate_continue_from_past_key_values"),
    Run("gpt_neox", "torch", f"{_TRAIN} or {_RETAIN}"),
)
#: What the CI subset must have patched at least once (``op:kernel`` in some run's models).
CI_MUST_COVER = {
    "ops": ("rms_norm", "gated_rms_norm", "layer_norm", "swiglu", "geglu", "mlp", "rope", "moe_experts",
            "linear_attention", "fused_linear_cross_entropy"),
    "kernels": ("torch", "compiled", "liger"),
}


def _folders_by_type() -> dict[str, str | None]:
    """Each bundled model type -> the test folder that tests it (``qwen2_5_vl_text``: ``qwen2_5_vl``), or None."""
    sys.path.insert(0, str(ROOT))
    from engine.loader import bundled_names, load_patchset

    found: dict[str, str | None] = {}
    for name in bundled_names():
        for model_type in load_patchset(name).model_types:
            found.setdefault(model_type, None)
            for folder in (model_type, model_type.removesuffix("_text_model"), model_type.removesuffix("_text")):
                if (TESTS_DIR / "tests" / "models" / folder / f"test_modeling_{folder}.py").exists():
                    found[model_type] = folder
                    break
    return found


def families() -> list[str]:
    """The test folders of the bundled model types (``qwen2_5_vl_text`` is tested in ``qwen2_5_vl``)."""
    return sorted({f for f in _folders_by_type().values() if f})


def setup() -> None:
    """transformers 5.15.1 and the test deps into TF_DIR; its tests unpacked into TESTS_DIR (each once)."""
    if not (TF_DIR / ".complete").exists():
        shutil.rmtree(TF_DIR, ignore_errors=True)
        pip = [sys.executable, "-m", "pip", "install", "-q", "--target", str(TF_DIR)]
        subprocess.run([*pip, "--no-deps", f"transformers=={RELEASE}", *TEST_DEPS], check=True)
        needed = subprocess.run([sys.executable, str(ROOT / ".ci" / "matrix_deps.py"), str(TF_DIR)], check=True,
                                capture_output=True, text=True).stdout.split()
        if needed:
            subprocess.run([*pip, *needed], check=True)
        # transformers 5.25 brought HF `kernels` into the venv, and this release changes behaviour beside it
        # (it wraps functions in kernels' modules): hidden as .ci/matrix hides it, a module that fails to
        # import found first on the path, and metadata below every release's minimum.
        (TF_DIR / "kernels").mkdir(exist_ok=True)
        (TF_DIR / "kernels" / "__init__.py").write_text('raise ImportError("kernels is hidden by the hf-suite")\n')
        (TF_DIR / "kernels-0.0.0.dist-info").mkdir(exist_ok=True)
        (TF_DIR / "kernels-0.0.0.dist-info" / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: kernels\nVersion: 0.0.0\n")
        (TF_DIR / ".complete").touch()
    if not (TESTS_DIR / "tests").exists():
        with tarfile.open(TARBALL) as tar:
            tar.extractall(WORK, filter="data")
    link = TESTS_DIR / "src" / "transformers"  # some utilities look the package up there (the tree's README)
    if not link.exists():
        link.parent.mkdir(exist_ok=True)
        link.symlink_to(TF_DIR / "transformers")


def run(spec: Run, results: Path, *, threads: int | None = None) -> Path:
    """One pytest process for ``spec``; returns its results JSON (also written when tests fail)."""
    out = results / f"{spec.name}.json"
    test_file = f"tests/models/{spec.family}/test_modeling_{spec.family}.py"
    cmd = [sys.executable, "-m", "pytest", test_file, "-q", "-p", "no:cacheprovider", "-p", "hf_suite_plugin",
           "--timeout", str(TIMEOUT_S), "-o", "addopts=", "--rootdir", ".", "-c", os.devnull]
    if spec.selection:
        cmd += ["-k", spec.selection]
    hidden = [] if spec.mode == "interpret" else [str(_hiding(HIDDEN[spec.family]))] if spec.family in HIDDEN else []
    hidden += [str(_stubbing(STUBBED[spec.family]))] if spec.family in STUBBED else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*hidden, str(TF_DIR), str(ROOT), str(HERE)]),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_SUITE_MODE": spec.mode, "HF_SUITE_OUT": str(out),
           "HF_SUITE_SELECTION": spec.selection, "PATCH_ENGINE_CACHE_DIR": str(results / "cache")}
    if spec.patchset:
        env["HF_SUITE_PATCHSET"] = spec.patchset
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    out.unlink(missing_ok=True)
    start = time.time()
    with open(results / f"{spec.name}.log", "w") as log:
        rc = subprocess.run(cmd, cwd=TESTS_DIR, env=env, stdout=log, stderr=subprocess.STDOUT, check=False).returncode
    if not out.exists():  # pytest died before its session finished: a row that says so
        out.write_text(json.dumps({"mode": spec.mode, "patchset_override": spec.patchset, "selection": spec.selection,
                                   "exitstatus": rc, "wall_s": round(time.time() - start, 1), "counts": {},
                                   "models": {"built": 0, "patched": 0, "refused": {}, "no_patchset": {}, "crashed": {},
                                              "kernels": {}, "warnings": {}, "activations": {}},
                                   "compiled": {}, "tests": {}}))
    print(f"{spec.name}{' -k ' + repr(spec.selection) if spec.selection else ''}: exit {rc}, "
          f"{time.time() - start:.0f} s", flush=True)
    return out


def run_all(specs: list[Run], results: Path, jobs: int, again: bool) -> None:
    results.mkdir(parents=True, exist_ok=True)
    todo = [s for s in specs if again or not (results / f"{s.name}.json").exists()]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(lambda s: run(s, results, threads=1 if jobs > 1 else None), todo))


def rows(specs: list[Run], results: Path, baseline: dict[str, Run] | None = None) -> list[dict[str, Any]]:
    """A summary row for each patched run in ``specs``, compared with its family's unpatched run.

    The unpatched run is ``baseline[family]`` where given (the CI subset's union of selections), else the
    unpatched run of the same selection where there is one, else the family's whole file unpatched, else
    the sweep's (``SWEEP_SELECTION``: it holds every other mode's selection).
    """
    out = []
    for spec in specs:
        if spec.mode == "off":
            continue
        candidates = [baseline[spec.family]] if baseline else [Run(spec.family, "off", spec.selection),
                                                               Run(spec.family, "off"),
                                                               Run(spec.family, "off", SWEEP_SELECTION)]
        off_path = next((p for c in candidates if (p := results / f"{c.name}.json").exists()), None)
        off = report.load(off_path) if off_path else None
        row = report.summarize(spec.family, spec.mode, off, report.load(results / f"{spec.name}.json"))
        out.append({**row, "selection": spec.selection})
    return out


def _environment() -> str:
    import importlib.metadata as md

    return (f"transformers {RELEASE}, torch {md.version('torch')}, liger-kernel {md.version('liger_kernel')}, "
            f"flash-linear-attention {md.version('flash-linear-attention')}, {platform.machine()} CPU, "
            f"{os.cpu_count()} cores, {datetime.date.today().isoformat()}")


def write_summary(name: str, new_rows: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """Merge ``new_rows`` into ``SUMMARY/name.json`` (a row per family, mode, patchset and selection; newest wins)."""
    path = SUMMARY / f"{name}.json"
    old = report.load(path) if path.exists() else {"rows": []}
    key = lambda r: (r["family"], MODES.index(r["mode"]), r.get("patchset") or "", r.get("selection", ""))
    merged = {key(r): r for r in old["rows"]} | {key(r): r for r in new_rows}
    data = {**old, **extra, "environment": _environment(), "rows": [merged[k] for k in sorted(merged)]}
    SUMMARY.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    return data


def render_page() -> None:
    from method import method

    summary = report.load(SUMMARY / "summary.json") if (SUMMARY / "summary.json").exists() else {"rows": []}
    ci = report.load(SUMMARY / "ci.json") if (SUMMARY / "ci.json").exists() else None
    by_type = _folders_by_type() if (TESTS_DIR / "tests").exists() else None
    listed = sorted({f for f in by_type.values() if f}) if by_type else None
    untested = sorted(t for t, f in by_type.items() if f is None) if by_type else []
    causes = yaml.safe_load((HERE / "causes.yaml").read_text(encoding="utf-8")) or []
    page = report.render(summary, method(ci, CI_RUNS, SELECTIONS), listed, SELECTIONS, causes)
    if by_type:
        line = (f"{len(listed)} test files test {len(by_type) - len(untested)} of the {len(by_type)} bundled model types "
                f"(a text or vision sub-type in its parent's file); 5.15.1's tree has none for "
                f"{', '.join(untested) or '-'}.")
        page = page.replace("## Sweep status\n\n", f"## Sweep status\n\n{line}\n\n", 1)
    PAGE.write_text(page, encoding="utf-8")
    print(f"wrote {PAGE.relative_to(ROOT)}")


def ci(results: Path, jobs: int) -> int:
    """The CI subset; 1 when a patched outcome differs, a run is a harness failure, or an op or kernel went untested."""
    start = time.time()
    selections: dict[str, list[str]] = {}
    for spec in CI_RUNS:
        selections.setdefault(spec.family, []).append(f"({spec.selection})")
    offs = [Run(f, "off", " or ".join(s)) for f, s in selections.items()]
    run_all(offs + list(CI_RUNS), results, jobs, again=True)
    found = rows(list(CI_RUNS), results, {o.family: o for o in offs})
    covered = {k for r in found for k in r["models"]["kernels"]}
    missing = [op for op in CI_MUST_COVER["ops"] if not any(k.startswith(op + ":") for k in covered)]
    missing += [kernel for kernel in CI_MUST_COVER["kernels"] if not any(k.endswith(":" + kernel) for k in covered)]
    wall = round(time.time() - start)
    write_summary("ci", found, wall_s=wall, jobs=jobs, missing=missing)
    failed = 0
    for row in found:
        name = row["family"] + f" {row['mode']}" + (f" ({row['patchset']})" if row.get("patchset") else "")
        for problem in row["problems"]:
            print(f"FAIL {name}: {problem}")
            failed += 1
        for d in row.get("differences", []):
            print(f"FAIL {name}: {d['test']}: {d['unpatched']} unpatched, {d['patched']} patched: {d['message']}")
            failed += 1
        print(f"{name}: unpatched {report._cell(row.get('unpatched', {}))}, patched "
              f"{report._cell(row.get('patched', {}))}, {report._models(row)} models patched")
    for item in missing:
        print(f"FAIL: the CI subset patched no model with {item}")
    print(f"hf-suite CI subset: {wall} s, {'failed' if failed or missing else 'passed'}")
    return 1 if failed or missing else 0


def collect_results(results: Path) -> int:
    """Every family's runs at hand (each mode's selection and the whole file) into the summary, then the page.

    A sweep writes its own rows when it ends; this is for a sweep stopped before its end, or run in parts."""
    setup()
    specs = [spec for f in families() for m in MODES if m != "off"
             for spec in (Run(f, m, SELECTIONS.get(m, "")), Run(f, m))
             if (results / f"{spec.name}.json").exists()]
    write_summary("summary", rows(list(dict.fromkeys(specs)), results))
    render_page()
    print(f"{len(specs)} runs collected")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("setup")
    sweep = sub.add_parser("sweep")
    sweep.add_argument("families", nargs="*", help="test folders (default: every bundled family's)")
    sweep.add_argument("--modes", default=",".join(MODES))
    sweep.add_argument("--again", action="store_true", help="rerun runs that have results already")
    sweep.add_argument("-k", dest="select", default="",
                       help="a pytest -k selection for every mode (its rows say so; unpatched: the same selection)")
    sweep.add_argument("--whole", action="store_true", help="every mode runs the whole file (no selection)")
    for p in (sweep, sub.add_parser("ci")):
        p.add_argument("--results", type=Path, default=RESULTS)
        p.add_argument("--jobs", type=int, default=1, help="pytest processes at a time (one per core)")
    sub.add_parser("render")
    collect = sub.add_parser("collect", help="the summary and page from the results at hand (runs nothing)")
    collect.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if getattr(args, "results", None) is not None:  # the runs' pytest works in the test tree: a relative path would move
        args.results = args.results.resolve()
    if args.command == "render":
        render_page()
        return 0
    if args.command == "collect":
        return collect_results(args.results)
    setup()
    if args.command == "setup":
        return 0
    if args.command == "ci":
        code = ci(args.results, args.jobs)
        render_page()
        return code
    modes = list(dict.fromkeys(["off", *args.modes.split(",")]))  # the unpatched run is every mode's baseline
    if unknown := [m for m in modes if m not in MODES]:
        parser.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    chosen = lambda mode: "" if args.whole else args.select or SELECTIONS.get(mode, "")
    specs = [Run(f, m, chosen(m)) for f in (args.families or families()) for m in modes]
    run_all(specs, args.results, args.jobs, args.again)
    write_summary("summary", rows(specs, args.results))
    render_page()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
