#!/usr/bin/env bash
# Download, on a machine with internet, every wheel the offline GPU machine needs into .whl/
# (ignored by git), so that tests/gpu/device_check.sh installs them there with --no-index.
#
# The GPU machine to expect: Python 3.12, manylinux x86-64, with torch 2.11, transformers 5.17,
# triton 3.6, peft and accelerate, but no liger-kernel and no fla. So: liger-kernel and
# flash-linear-attention (+ fla-core, einops) without their dependencies (they would pull a torch
# and a triton), this project's own wheel, and its small pure dependencies (pydantic, pyyaml,
# packaging) and pytest with theirs, in case the machine lacks them.
#
#   bash tests/gpu/fetch_wheels.sh            # from the repository root; PYTHON=... to pick the pip
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
DEST=.whl
mkdir -p "$DEST"
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
        --platform any -d "$DEST")

# Vendor kernels: exact versions this project is tested with, no dependencies.
"$PYTHON" -m pip download "${TARGET[@]}" --no-deps \
    "liger-kernel==0.8.5" "flash-linear-attention==0.6.0" "fla-core==0.6.0" "einops>=0.8"

# Pure dependencies of this project and of the GPU tests, with their own dependencies
# (none of them depends on torch).
"$PYTHON" -m pip download "${TARGET[@]}" \
    "pydantic>=2.7,<3" "pyyaml>=6.0,<7" "packaging>=23" "pytest>=8,<10"

# This project's own wheel (pure Python; bundles patchsets/ and schemas/).
"$PYTHON" -m pip wheel --no-deps -w "$DEST" . >/dev/null

echo "wheels in $DEST:"
ls -1 "$DEST"
for required in liger_kernel-0.8.5 flash_linear_attention-0.6.0 fla_core-0.6.0 patch_engine-; do
    ls "$DEST" | grep -q "^${required}" || { echo "missing: ${required}*" >&2; exit 1; }
done
du -sh "$DEST"
