#!/usr/bin/env bash
# One call on the offline GPU machine: install the prepared wheels, run the CUDA tests and the
# CUDA benchmark, and write everything to $OUT (default benchmarks/results). Under 12 minutes:
# each stage has its own time limit, and a stage that fails or times out does not stop the next.
#
#   bash tests/gpu/fetch_wheels.sh     # before, on a machine with internet: fills .whl/
#   bash tests/gpu/device_check.sh     # on the GPU machine, from the repository root
#
# Writes: $OUT/cuda.json, $OUT/cuda.md (benchmarks/device_suite.py), $OUT/gpu_tests.log,
# $OUT/interpret_vs_gpu.{json,md} (the same verify interpreted on the CPU and run on the GPU, check by
# check: confirms the verdicts of `verify --interpret`, docs/devices.md "Interpreted on CPU"),
# $OUT/device_check.log (versions, stage times and exit codes).
set -uo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
LOG="$OUT/device_check.log"
: > "$LOG"
stage() {  # stage NAME SECONDS COMMAND...: run with a time limit, log the exit code and the time
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$@"
    rc=$?
    echo "$name: exit $rc in $(( $(date +%s) - start ))s (limit ${limit}s)" | tee -a "$LOG"
    return 0
}

[ -d .whl ] || { echo "no .whl/ here: run tests/gpu/fetch_wheels.sh on a machine with internet first" >&2; exit 2; }
# Installs only what is missing; torch, triton and transformers stay the machine's own. The project
# and the vendor kernels go in without dependencies: the machine's torch (2.11) is older than the
# floor pyproject.toml declares (torch>=2.13, the oldest release CI tests), which pip --no-index
# could not satisfy; the GPU checks run on the machine's torch on purpose.
stage install 60 "$PYTHON" -m pip install --no-index --find-links .whl --quiet --no-deps \
    patch-engine liger-kernel flash-linear-attention fla-core einops
stage install-deps 60 "$PYTHON" -m pip install --no-index --find-links .whl --quiet \
    "pydantic>=2.7,<3" "pyyaml>=6.0,<7" "packaging>=23" "pytest>=8,<10"
"$PYTHON" - <<'PY' | tee -a "$LOG"
import importlib, platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "|", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device")
for name in ("transformers", "triton", "liger_kernel", "fla", "peft", "accelerate", "engine"):
    try:
        module = importlib.import_module(name)
        print(f"{name}: {getattr(module, '__version__', 'installed')} ({getattr(module, '__file__', '')})")
    except Exception as exc:
        print(f"{name}: not importable ({type(exc).__name__}: {exc})")
PY
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's engine, not the installed wheel's
# Liger's fused MoE autotunes over many Triton configs on first call (minutes); one config keeps
# the run inside its time (liger_kernel/ops/fused_moe.py documents this switch).
export LIGER_FUSED_MOE_AUTOTUNE=${LIGER_FUSED_MOE_AUTOTUNE:-0}
stage gpu-tests 180 bash -c "bash tests/gpu/run_all.sh > '$OUT/gpu_tests.log' 2>&1"
tail -5 "$OUT/gpu_tests.log"
stage interpret-vs-gpu 240 "$PYTHON" tests/gpu/interpret_vs_gpu.py --out "$OUT"
stage cuda-bench 200 "$PYTHON" benchmarks/run.py --device cuda --out "$OUT"
cat "$LOG"
