"""What a patched module costs per call at decode size (one token), against the original forward.

Why: at decode every norm, MLP and attention call works on one row, so a fixed cost per call
(the installed forward, the kernel's rule check, the rope function's routing) is a larger share
than anywhere else; ``auto`` must not make decoding slower. For the layers of the two real
checkpoints (SmolLM2-135M: llama, hidden 576; Gemma 3 270M: hidden 640, per-head q/k norms,
GeGLU), built from their configs with one decoder layer and random weights, fp32: the norm, the
MLP and the whole decoder layer (attention with the routed rope function) at 1 token, called as
modules, unpatched vs patched with the bundled patchset (``auto``, compiled kernels on), in
interleaved loops, best of ``--rounds`` (load only adds time), microseconds per call.

    python benchmarks/decode_overhead.py

Writes ``benchmarks/results/decode_overhead_cpu.json`` and prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("PATCH_ENGINE_COMPILE", "1")

import torch

import engine

CONFIGS = {
    "smollm2 (llama)": ("llama", {"hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
                                  "num_key_value_heads": 3, "head_dim": 64, "num_hidden_layers": 1,
                                  "vocab_size": 512}),
    "gemma3 (gemma3_text)": ("gemma3_text", {"hidden_size": 640, "intermediate_size": 2048, "num_attention_heads": 4,
                                             "num_key_value_heads": 1, "head_dim": 256, "num_hidden_layers": 1,
                                             "query_pre_attn_scalar": 256, "vocab_size": 512,
                                             "layer_types": ["full_attention"], "sliding_window": 512}),
}


def _best(fns: dict[str, Any], rounds: int, calls: int) -> dict[str, float]:
    best = {k: float("inf") for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / calls * 1e6)
    return best


def _layer_inputs(model: torch.nn.Module, hidden: torch.Tensor) -> dict[str, Any]:
    inner = model.model
    position_ids = torch.zeros(1, 1, dtype=torch.long)
    rotary = inner.rotary_emb
    kwargs: dict[str, Any] = {"attention_mask": None, "position_ids": position_ids}
    if model.config.model_type == "gemma3_text":
        kwargs["position_embeddings"] = rotary(hidden, position_ids, layer_type="full_attention")
    else:
        kwargs["position_embeddings"] = rotary(hidden, position_ids)
    return kwargs


def run(rounds: int, calls: int) -> list[dict[str, Any]]:
    from engine.tiny import build_tiny_model

    rows = []
    for label, (model_type, config) in CONFIGS.items():
        reference = build_tiny_model(model_type, config, seed=0, attn_implementation="sdpa").eval()
        patched = copy.deepcopy(reference)
        engine.apply(patched, model_type, device="cpu", mode="inference")
        x = torch.randn(1, 1, config["hidden_size"])
        kwargs = _layer_inputs(reference, x)
        parts = {"norm": lambda m, x=x: m.model.layers[0].input_layernorm(x),
                 "mlp": lambda m, x=x: m.model.layers[0].mlp(x),
                 "decoder layer": lambda m, x=x, kw=kwargs: m.model.layers[0](x, **kw)}
        for part, call in parts.items():
            with torch.no_grad():
                assert torch.allclose(torch.as_tensor(_first(call(patched))), torch.as_tensor(_first(call(reference))),
                                      atol=1e-6, rtol=0), (label, part)
                t = _best({"unpatched": lambda c=call, m=reference: c(m), "patched": lambda c=call, m=patched: c(m)},
                          rounds, calls)
            row = {"model": label, "part": part, "unpatched_us": t["unpatched"], "patched_us": t["patched"],
                   "overhead_us": t["patched"] - t["unpatched"], "time_x": t["patched"] / t["unpatched"],
                   "load_average": os.getloadavg()[0]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, tuple) else out


def markdown(results: dict[str, Any]) -> str:
    loads = [r["load_average"] for r in results["rows"]]
    out = ["### Per-call cost at decode size (1 token), unpatched vs patched", "",
           (f"Written by `python benchmarks/decode_overhead.py`: one decoder layer of each checkpoint's shape, "
            f"fp32, no grad, best of {results['rounds']} interleaved loops of {results['calls']} calls; "
            f"torch {results['torch']}, {results['threads']} threads; load average {min(loads):.1f}-{max(loads):.1f}."),
           "", "| model | module | unpatched us | patched us | patched - unpatched us | time x |", "|---|---|---|---|---|---|"]
    for r in results["rows"]:
        out.append(f"| {r['model']} | {r['part']} | {r['unpatched_us']:.1f} | {r['patched_us']:.1f} | "
                   f"{r['overhead_us']:+.1f} | {r['time_x']:.2f}x |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/decode_overhead_cpu.json"))
    args = parser.parse_args(argv)
    results = {"torch": torch.__version__, "threads": torch.get_num_threads(), "rounds": args.rounds,
               "calls": args.calls, "rows": run(args.rounds, args.calls)}
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
