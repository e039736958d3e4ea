"""Per-call cost of how a patched forward is installed, side by side in one process.

Usage: ``python benchmarks/binding_overhead.py [--rounds 40] [--calls 2000]``

Compares, on a ``Qwen3RMSNorm(8)`` with the torch kernel (so the kernel itself is tiny and
the binding dominates), the best-of-``rounds`` time per call of:

* ``direct``: the kernel called with the module's weight and eps (no engine);
* ``captured eps, bound method``: the binding before issue 11 (eps read once at apply,
  ``MethodType(forward, module)``; not picklable, ignores a changed ``variance_epsilon``);
* ``live eps, PatchedForward``: what ``engine.apply`` installs now (eps read on every call,
  a ``functools.partial`` subclass that pickles as data).

Prints the times and the engine overhead of each binding (minus ``direct``). Interleaved in
fine-grained rounds so machine load hits every variant alike; best-of, since load only adds.
"""

from __future__ import annotations

import argparse
import timeit
from types import MethodType

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()

    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from engine.kernels import registry
    from engine.ops.base import get_op
    from engine.patching.bound_forward import Binding, PatchedForward
    from engine.schema import RmsNormPatch, Scale

    patch = RmsNormPatch(target="Qwen3RMSNorm", op="rms_norm", scale=Scale.weight, kernel="torch")
    module = Qwen3RMSNorm(8)
    impl = registry.get("torch", "rms_norm").build(patch)
    eps = float(module.variance_epsilon)

    def captured_forward(self: torch.nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
        return impl(hidden_states, self.weight, eps)

    variants = {
        "direct": None,
        "captured eps, bound method": MethodType(captured_forward, module),
        "live eps, PatchedForward": PatchedForward(
            get_op("rms_norm").bind(module, patch, impl), module, Binding("norm", "rms_norm", patch, "torch")
        ),
    }
    x, weight = torch.randn(1, 8), module.weight
    calls = {
        name: (lambda f=f: f(x)) if f is not None else (lambda: impl(x, weight, eps)) for name, f in variants.items()
    }
    best = dict.fromkeys(calls, float("inf"))
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, call in calls.items():
                best[name] = min(best[name], timeit.timeit(call, number=args.calls) / args.calls * 1e6)
    for name, us in best.items():
        extra = "" if name == "direct" else f"  (engine overhead {us - best['direct']:.2f} us)"
        print(f"{name:28s} {us:7.2f} us/call{extra}")


if __name__ == "__main__":
    main()
