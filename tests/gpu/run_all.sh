#!/usr/bin/env bash
# Run every CUDA parity check with a summary. On a GPU machine, from the repository root:
#   pip install -e ".[dev,cuda,fla]"   # liger-kernel + flash-linear-attention, with a CUDA torch
#   tests/gpu/run_all.sh
# Exit status: pytest's (0 = all passed). Expected wall time: 1-3 minutes (first Triton compiles dominate).
set -uo pipefail
cd "$(dirname "$0")/../.."
python - <<'PY'
import importlib.util, torch
print(f"torch {torch.__version__}, cuda available: {torch.cuda.is_available()}",
      f"({torch.cuda.get_device_name(0)})" if torch.cuda.is_available() else "")
for mod in ("liger_kernel", "fla", "triton", "transformers"):
    spec = importlib.util.find_spec(mod)
    if spec is None:
        print(f"{mod}: not installed (its tests skip)")
    else:
        m = __import__(mod)
        print(f"{mod}: {getattr(m, '__version__', '?')}")
if not torch.cuda.is_available():
    raise SystemExit("no CUDA device: nothing to run (tests/gpu would all skip)")
PY
[ $? -eq 0 ] || exit 2
start=$(date +%s)
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python -m pytest tests/gpu -m cuda -p no:cacheprovider -q -rA --tb=short "$@"
rc=$?
echo "tests/gpu: exit $rc in $(( $(date +%s) - start ))s"
exit $rc
