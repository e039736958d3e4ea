"""What keying verdicts by the identity of the live code costs a stock model's bundled apply (issue 45).

The gate's bundled path now also computes the identity of every class and function the plan
patches (:func:`engine.releases.code.patched_code`) and compares it with the manifest. Measured
here, side by side in one process, on models built from config on the meta device's shapes but
real CPU tensors (the identity does not read weights): the plan alone, the gate's answer without
the code check (content and release: what it was before), and with it; cold (the first apply in a
fresh process: files compiled, code objects digested) and warm (median of 20).

    PYTHONPATH=. python benchmarks/code_identity.py --out benchmarks/results/code_identity.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

CASES = {  # name -> (model_type, config overrides, bundled patchset): the sizes of the checkpoints named
    "SmolLM2-135M": ("llama", {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                               "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152}, "llama"),
    "Gemma 3 270M": ("gemma3_text", {"hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
                                     "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                                     "vocab_size": 262144}, "gemma3_text"),
    "Qwen3-0.6B-sized": ("qwen3", {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                                   "vocab_size": 151936}, "qwen3"),
}

_ONE = """
import json, sys, time, warnings
warnings.simplefilter("ignore")
import torch, transformers
from transformers import AutoConfig, AutoModelForCausalLM
import engine
from engine.releases.known import not_known_verified
from engine.releases.code import patched_code
model_type, overrides, name = json.loads(sys.argv[1])
config = AutoConfig.for_model(model_type, **overrides)
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(config)
t = time.perf_counter(); plan = engine.plan(model, name, device="cpu"); plan_s = time.perf_counter() - t
t = time.perf_counter(); before = not_known_verified(plan); before_s = time.perf_counter() - t
t = time.perf_counter(); after = not_known_verified(plan, model); cold_s = time.perf_counter() - t
assert after[0] is None, after
warm = []
for _ in range(20):
    t = time.perf_counter(); not_known_verified(plan, model); warm.append(time.perf_counter() - t)
print(json.dumps({"plan_s": plan_s, "without_code_s": before_s, "with_code_cold_s": cold_s,
                  "with_code_warm_s": sorted(warm)[len(warm) // 2], "classes": len(patched_code(model, plan.patched)),
                  "patched_modules": len(plan.patched)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="benchmarks/results/code_identity.json")
    args = parser.parse_args()
    rows = {}
    for label, case in CASES.items():
        runs = []
        for _ in range(3):  # fresh processes: cold is cold
            done = subprocess.run([sys.executable, "-c", _ONE, json.dumps(case)], capture_output=True, text=True,
                                  check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        rows[label] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        print(label, {k: round(v * 1000, 2) if k.endswith("_s") else v for k, v in rows[label].items()}, flush=True)
    Path(args.out).write_text(json.dumps({"when": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1) + "\n",
                              encoding="utf-8")


if __name__ == "__main__":
    main()
