"""A newcomer's first run works on the day they install: the README's commands, the newest releases, the demo.

``test_the_readmes_commands_with_the_newest_releases_patch_verify_and_print_numbers`` builds what
the README's Install block builds, command by command as a newcomer types them, in a fresh venv
with whatever the registry serves today (no lock: ``pip install torch`` takes the newest torch,
``pip install -e ".[dev]"`` the newest transformers, peft, accelerate our ranges admit), then runs
``patch-engine demo``: it must patch, verify and print numbers that match. On a transformers release
newer than the bundled ranges that is the self-verification path (docs/versions.md), which is the
point: the day 5.25.0 came out, this demo printed a refusal and did nothing.

It downloads a torch (GBs for PyPI's CUDA build), so it runs only where ``PATCH_ENGINE_NEWCOMER_VENV``
names the venv to build (``.ci/newest``, which then reuses that venv for the newest-releases
column and tests); the suite skips it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VENV = os.environ.get("PATCH_ENGINE_NEWCOMER_VENV")


def readme_install_commands() -> list[str]:
    """The ``pip install`` lines of the README's Install block, without their comments, in order."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Install\n.*?```bash\n(.*?)```", text, re.DOTALL)
    assert block, "README.md has no ```bash block under ## Install"
    lines = [line.split("#", 1)[0].strip() for line in block.group(1).splitlines()]
    return [line for line in lines if line.startswith("pip install")]


def readme_test_command() -> str:
    """The README's test command: the line of the first ```bash block under ## Tests that runs pytest."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.search(r"\n## Tests\n(.*?)(?:\n## |\Z)", text, re.DOTALL)
    assert section, "README.md has no ## Tests section"
    for block in re.findall(r"```bash\n(.*?)```", section.group(1), re.DOTALL):
        for line in block.splitlines():
            if "pytest" in line.split("#", 1)[0]:
                return line.split("#", 1)[0].strip()
    raise AssertionError("README.md's ## Tests section shows no pytest command in a ```bash block")


def test_the_readme_install_block_is_what_a_newcomer_runs() -> None:
    commands = readme_install_commands()
    assert commands[0].startswith("pip install torch") and any('-e ".[dev]"' in c for c in commands), commands
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "patch-engine demo" in text.split("## Install", 1)[1].split("```", 2)[1]


@pytest.mark.skipif(not VENV, reason="builds a venv with the newest releases (GBs): .ci/newest sets "
                                     "PATCH_ENGINE_NEWCOMER_VENV")
def test_the_readmes_commands_with_the_newest_releases_patch_verify_and_print_numbers() -> None:
    venv = Path(VENV).absolute()
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    python = venv / "bin" / "python"
    env = {**os.environ, "PIP_CONSTRAINT": os.devnull, "VIRTUAL_ENV": str(venv),  # the newest: no cap, no lock
           "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    for own in ("PYTHONPATH", "PATCH_ENGINE_COMPILE", "PATCH_ENGINE_UNVERIFIED_RELEASE"):  # tests/conftest.py's, not a newcomer's
        env.pop(own, None)
    for command in readme_install_commands():
        args = shlex.split(command)
        subprocess.run([str(python), "-m", *args, "-q"], check=True, cwd=ROOT, env=env)
    done = subprocess.run([str(venv / "bin" / "patch-engine"), "demo"], cwd=venv, env=env, capture_output=True,
                          text=True, timeout=900, check=False)
    shown = done.stdout + done.stderr
    assert done.returncode == 0, shown
    code = "import torch, transformers; print(torch.__version__, transformers.__version__)"
    versions = subprocess.run([str(python), "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    print(f"newcomer's venv: torch, transformers {versions.strip()}\n{shown}")
    assert re.search(r"qwen3 \(\w+, training\): [1-9]\d* patched", shown), shown  # it patched
    assert "verification passed" in shown  # it verified
    assert "numbers match" in shown and "logits max |diff|" in shown  # and printed the numbers


def test_the_readmes_first_example_runs_offline(capsys) -> None:
    """The first Python a reader meets runs as shown, on any machine, with no download: a tiny model the package
    builds, patched, a training step, reverted. (The real checkpoint comes second.)"""
    import engine

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    first = re.search(r"```python\n(.*?)```", text, re.DOTALL)
    assert first, "README.md shows no Python example"
    code = first.group(1)
    assert "from_pretrained" not in code and "cuda" not in code, "the first example needs the Hub or a GPU"
    namespace: dict = {}
    exec(compile(code, "README.md's first example", "exec"), namespace)  # noqa: S102 - the README's own code
    model = namespace["model"]
    assert re.search(r"qwen3 \(cpu, \w+\): 12 patched", capsys.readouterr().out)
    assert not engine.is_patched(model) and all(p.grad is not None for p in model.parameters())


def test_ci_runs_the_readmes_own_path() -> None:
    """.ci/readme-path takes its commands from README.md (this module), so the README and CI cannot drift apart."""
    script = (ROOT / ".ci" / "readme-path").read_text(encoding="utf-8")
    assert "tests/test_newcomer.py install" in script and "tests/test_newcomer.py test" in script
    assert readme_test_command() == "python -m pytest -q"
    assert "readme-path" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


if __name__ == "__main__":  # .ci/readme-path: the README's commands, one a line
    what = sys.argv[1] if len(sys.argv) > 1 else "install"
    print("\n".join(readme_install_commands()) if what == "install" else readme_test_command())
