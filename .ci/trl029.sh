#!/usr/bin/env bash
# CI: tests/test_trl.py against trl 0.29.1, which cannot share a venv with the trl 1.x of the main suite.
# trl 0.29 reads outputs.logits every SFT step; the test asserts the engine refuses the fused head there
# (and that the layer patches train like the unpatched model).
#
# Fast path (~1 minute): after .ci/run, the venv holds only trl 0.29.1 (--no-deps) and sees every other
# package (torch, transformers, peft, datasets, the project) through the CI venv's site-packages, added
# *after* its own, so `import trl` finds 0.29.1. Without the CI venv, a full venv is built (~5 minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
MAIN_VENV="${MAIN_VENV:-.ci-venv}"
VENV="${TRL029_VENV:-.ci-venv-trl029}"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import trl, engine, torch; assert trl.__version__ == '0.29.1'" 2>/dev/null; then
    rm -rf "$VENV"
    if [ -x "$MAIN_VENV/bin/python" ] && "$MAIN_VENV/bin/python" -c "import torch, transformers, peft, datasets, engine" 2>/dev/null; then
        python3 -m venv "$VENV"
        "$VENV/bin/python" -m pip install -q --no-deps "trl==0.29.1"
        main_site="$("$MAIN_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        own_site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
        echo "import site; site.addsitedir('$(cd "$main_site" && pwd)')" > "$own_site/zz_ci_venv.pth"
    else
        python3 -m venv "$VENV"
        "$VENV/bin/python" -m pip install -q --upgrade pip
        # torch first, pinned: the CPU wheel on this machine's disk (a range would download a CUDA build).
        "$VENV/bin/python" -m pip install -q "torch==2.13.0"
        "$VENV/bin/python" -m pip install -q -e ".[dev]" "trl==0.29.1"
    fi
fi
"$VENV/bin/python" -c "import trl, transformers, torch; print('trl', trl.__version__, 'transformers', transformers.__version__, 'torch', torch.__version__)"
"$VENV/bin/python" -m pytest -q -p no:cacheprovider tests/test_trl.py
