"""One story of the torch releases CI tests: README.md and the docs say what `.ci/tested-torch.yaml` says.

Why: the README once said "CI tests 2.13.0 and 2.14.1" while docs/compatibility.md listed 2.15.0 too,
and docs/testing.md installed 2.13.0 only. The data file is the source; the docs' tables are rendered
from it (``python tests/test_tested_torch.py`` rewrites them) and the README's sentence is checked.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / ".ci" / "tested-torch.yaml"
PAGES = [ROOT / "docs" / "compatibility.md", ROOT / "docs" / "testing.md"]
BEGIN, END = "<!-- tested-torch:begin (generated from .ci/tested-torch.yaml; do not edit) -->", "<!-- tested-torch:end -->"


def data() -> dict:
    return yaml.safe_load(DATA.read_text(encoding="utf-8"))


def _versions(scope: str) -> str:
    found = [row["version"] for row in data()["torch"] if row["scope"] == scope]
    return ", ".join(found[:-1]) + (" and " if len(found) > 1 else "") + found[-1]


def readme_sentence() -> str:
    """What the README's Install section says CI tests."""
    return f"CI runs the whole suite on torch {_versions('whole')} and the core tests on {_versions('core')}"


def table() -> str:
    """The table both docs pages show, between the markers."""
    rows = ["| torch | build | what CI runs | step |", "|---|---|---|---|"]
    for row in data()["torch"]:
        rows.append(f"| {row['version']} | {row['build']} | {row['runs']} | `{row['step']}` |")
    newest = data()["newest"]
    rows.append(f"| newest | whatever PyPI serves | {newest['runs']} | `{newest['step']}` |")
    return "\n".join([BEGIN, *rows, END])


def _block(text: str) -> str | None:
    found = re.search(re.escape(BEGIN) + r".*?" + re.escape(END), text, re.DOTALL)
    return found.group(0) if found else None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_docs_table_is_the_data(page: Path) -> None:
    assert _block(page.read_text(encoding="utf-8")) == table(), (
        f"{page.relative_to(ROOT)}: the tested-torch table differs from .ci/tested-torch.yaml; "
        "run `python tests/test_tested_torch.py`")


def test_the_readme_says_the_same() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    install = readme.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert readme_sentence() in " ".join(install.split()), readme_sentence()


def test_every_step_named_exists_and_ci_runs_it() -> None:
    run = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    for row in [*data()["torch"], data()["newest"]]:
        step = row["step"]
        assert (ROOT / step).exists(), step
        assert step == ".ci/run" or step.removeprefix(".ci/") in run.split("STACKS=", 1)[1].splitlines()[0], step


if __name__ == "__main__":  # rewrite the tables in the docs from the data
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        if _block(text) is None:
            sys.exit(f"{page}: no {BEGIN} ... {END} block to rewrite")
        page.write_text(text.replace(_block(text), table()), encoding="utf-8")
