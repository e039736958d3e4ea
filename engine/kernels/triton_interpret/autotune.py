"""Shim ``autotune``: autotuned kernels pick a config without timing it on a GPU.

Why: fla's chunk kernels are autotuned, and the autotuner's benchmarker and its disk cache key
both ask the GPU driver, which a CPU-only machine does not have. Interpreted timings would mean
nothing anyway, so every config times the same and the first one runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.kernels.triton_interpret._state import Shim, set_attr

__all__ = ["SHIMS", "install"]

SHIMS: tuple[Shim, ...] = (
    Shim("autotune",
         "an autotuned kernel (fla's chunk kernels) benchmarks its configs with the driver's benchmarker, "
         "which needs a GPU driver, and one with cache_results (fla's l2norm) keys its disk cache by the "
         "driver's target: RuntimeError: 0 active drivers ([]). There should only be one.",
         "every config times the same, so the first config runs (timing means nothing in the interpreter); "
         "no disk cache",
         "Autotuner.do_bench works under TRITON_INTERPRET on a machine without a GPU driver"),
)


def install() -> None:
    """Constant timings and no disk cache for every autotuned kernel."""
    from triton.runtime.autotuner import Autotuner

    def do_bench(self: Any) -> Callable[..., list[float]]:
        def bench(kernel_call: Callable[[], None], quantiles: Any = None) -> list[float]:
            return [1.0, 1.0, 1.0]  # not run: the interpreter's time says nothing about a GPU's

        return bench

    def check_disk_cache(self: Any, tuning_key: Any, configs: Any, bench_fn: Callable[[], None]) -> bool:
        bench_fn()  # no disk cache: its key asks the driver for the GPU target
        return False

    set_attr(Autotuner, "do_bench", property(do_bench))
    set_attr(Autotuner, "check_disk_cache", check_disk_cache)
