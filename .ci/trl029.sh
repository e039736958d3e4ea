#!/usr/bin/env bash
# CI: tests/test_trl.py against trl 0.29.1, which cannot share a venv with the trl 1.x of the main suite.
# trl 0.29 reads outputs.logits every SFT step; the test asserts the engine refuses the fused head there
# (and that the layer patches train like the unpatched model). ~2 minutes; the venv is reused when present.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${TRL029_VENV:-.ci-venv-trl029}"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import trl, engine" 2>/dev/null; then
    python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    # torch first, pinned: the CPU wheel on this machine's disk (a range would download a CUDA build).
    "$VENV/bin/python" -m pip install -q "torch==2.13.0"
    "$VENV/bin/python" -m pip install -q -e ".[dev]" "trl==0.29.1"
fi
"$VENV/bin/python" -m pip list 2>/dev/null | grep -iE "^(torch|transformers|trl|peft|datasets) " || true
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_trl.py
