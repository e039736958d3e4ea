"""The documentation a newcomer reads holds together: the README's test command, an index of
every page, links that lead somewhere, and no references to the project's issue tracker."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_readme_shows_the_test_command_ci_runs() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "```bash\npython -m pytest -q\n```" in readme
    assert "python -m pytest -q" in (ROOT / ".ci" / "run").read_text()


def test_the_docs_index_lists_every_page_once() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    listed = re.findall(r"^\| \[([\w.]+\.md)\]\(\1\) \|", index, re.MULTILINE)
    pages = [p.name for p in DOCS if p.name != "README.md"]
    assert sorted(listed) == sorted(pages) and len(listed) == len(set(listed))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_lead_to_files(page: Path) -> None:
    missing = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists():
            missing.append(target)
    assert not missing, f"{page.name} links to files that do not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_issue_numbers_in_user_facing_docs(page: Path) -> None:
    # this project's own tracker ("issue 10", "issue 12 part 2"): a reader cannot follow it. Another
    # project's issue, named with its project and link, is a reference and stays.
    found = re.findall(r"(?i)(?<![\w/-])issues? #?\d{1,3}\b", page.read_text())
    assert not found, f"{page.name} refers to the project's issue numbers: {found}"
