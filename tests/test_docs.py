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


# --------------------------------------------------------------------------------------
# What a page shows is what the code does: commands parse, counts are the code's, names exist.
# Fast by design (no model is built, no command runs): the commands themselves run in
# tests/test_cli.py, tests/test_advice.py and tests/test_newcomer.py.

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
_SHELL_ENDS = ("|", ">", ">>", "&&", ";", "2>&1", "||")


def _prose(text: str) -> str:
    """The page without its code blocks."""
    return _FENCE.sub("", text)


def _shown_commands() -> list[tuple[str, str]]:
    """``(page, command)`` for every ``patch-engine ...`` line of every code block, continuations joined."""
    found = []
    for page in PAGES:
        for block in _FENCE.findall(page.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.strip().removeprefix("$ ")
                if line.startswith("patch-engine ") or line.startswith("python -m engine "):
                    found.append((page.relative_to(ROOT).as_posix(), line))
    return found


def _argv(command: str) -> list[str]:
    """A shown command's arguments after ``patch-engine``, without comments and what the shell does after it."""
    import shlex

    words = shlex.split(command, comments=True)
    words = words[1:] if words[0] == "patch-engine" else words[3:]  # python -m engine
    for i, word in enumerate(words):
        if word in _SHELL_ENDS:
            return words[:i]
    return words


def _parse(argv: list[str]) -> None:
    """Parse as the command line would (argparse exits 2 on anything it does not take), running nothing."""
    from engine.commands.bench import build_parser
    from engine.commands.cli import _parser

    if argv[:1] == ["bench"]:
        args = build_parser().parse_args(argv[1:])
        from engine.commands.bench import SECTIONS

        assert set(args.only.split(",")) <= set(SECTIONS), f"bench --only {args.only}: sections are {SECTIONS}"
    else:
        _parser().parse_args(argv)


def test_every_command_a_code_block_shows_parses() -> None:
    shown = _shown_commands()
    assert len(shown) > 30  # README, usage.md, audit.md, verification.md, ... show dozens
    bad = []
    for page, command in shown:
        try:
            _parse(_argv(command))
        except (SystemExit, AssertionError) as exc:
            bad.append(f"{page}: {command} ({exc})")
    assert not bad, "commands shown that the command line refuses:\n" + "\n".join(bad)


def test_every_flag_an_inline_command_names_exists() -> None:
    """``patch-engine verify --gguf`` in a sentence: the subcommand and each flag it names are the CLI's."""
    from engine.commands.bench import build_parser
    from engine.commands.cli import _parser

    commands = _parser()._subparsers._group_actions[0].choices  # the subcommands' parsers
    bad = []
    for page in PAGES:
        for span in re.findall(r"`(?:\$ )?patch-engine ([^`]+)`", _prose(page.read_text())):
            words = span.split()
            for sub in words[0].split("|"):  # `patch-engine plan|verify ... --unverified refuse`: each of them
                if sub not in commands:
                    bad.append(f"{page.name}: `patch-engine {span}`: no command {sub!r}")
                    continue
                parser = build_parser() if sub == "bench" else commands[sub]
                known = {opt for action in parser._actions for opt in action.option_strings}
                for flag in (w.split("=")[0] for w in words[1:] if w.startswith("--")):
                    if flag not in known:
                        bad.append(f"{page.name}: `patch-engine {span}`: {sub} has no {flag}")
    assert not bad, "\n".join(bad)


def test_the_counts_pages_state_are_the_codes() -> None:
    from engine.commands.coverage import bundled_by_type
    from engine.loader import bundled_names

    readme, usage = (ROOT / "README.md").read_text(), (ROOT / "docs" / "usage.md").read_text()
    hf_tests = (ROOT / "docs" / "hf_tests.md").read_text()
    types, files = len(bundled_by_type()), len(bundled_names())
    assert re.search(rf"\b{types} model types are bundled\b", readme), f"README: {types} model types are bundled"
    assert re.search(rf"\bThe {files} bundled today\b", usage), f"usage.md: the {files} bundled patchsets"
    assert re.search(rf"\bof the {types} bundled model types\b", hf_tests), f"hf_tests.md: {types} bundled types"
    # the README's coverage figure is the generated page's headline (checked against its own table below)
    headline = re.search(r"\*\*(\d+)\*\* of the (\d+) causal-LM and image-text-to-text types",
                         (ROOT / "docs" / "coverage.md").read_text())
    assert headline is not None
    assert f"the {headline[1]} of transformers' {headline[2]} generative types patched and verified" in readme


def _coverage_table() -> list[list[str]]:
    rows = []
    for line in (ROOT / "docs" / "coverage.md").read_text().splitlines():
        if line.startswith("| ") and not line.startswith("| model_type"):
            rows.append([cell.strip() for cell in line.split("|")[1:-1]])
    return rows


def test_the_coverage_pages_headline_is_its_tables_and_the_codes() -> None:
    """docs/coverage.md is generated; its headline counts its own rows, and its totals are the code's."""
    from engine.commands.coverage import LIGER_MODEL_TYPES, bundled_by_type
    from engine.tiny.config import generative_types

    text = (ROOT / "docs" / "coverage.md").read_text()
    rows = _coverage_table()
    generative = set(generative_types())
    bundled = [r for r in rows if r[1] not in ("-", "measured")]
    done = [r for r in rows if r[0] in generative and r[2] == "yes"]
    by_bundle = [r for r in done if r in bundled]
    assert f"- **{len(done)}** of the {len(generative)} causal-LM and image-text-to-text types" in text
    assert f"patched and verified ({100 * len(done) / len(generative):.0f}%): {len(by_bundle)} by a bundled" in text
    assert f"{len(done) - len(by_bundle)} by declarations the scaffold measured" in text
    assert len(bundled) == len(bundled_by_type())
    passing = sum(1 for r in bundled if r[2] == "yes")
    assert f"**{len(bundled)}** of {len(rows)} model types have a bundled patchset; **{passing}** of the" in text
    assert f"Liger-Kernel 0.8.5 patches {len(LIGER_MODEL_TYPES)} model types" in text
    shares = [float(r[3].rstrip("%")) for r in bundled if r[3] != "-"]
    half = re.search(r"(\d+) of (\d+) patch more than half of the model", text)
    assert half is not None and int(half[2]) == len(shares)
    # "more than half" counts shares > 50%; the page rounds to 0.1%, so a row shown as 50.0% may be either side
    assert sum(x > 50.0 for x in shares) <= int(half[1]) <= sum(x >= 50.0 for x in shares)


def test_the_exit_codes_pages_list_are_every_commands() -> None:
    from engine.commands import audit, cli

    codes = {cli.EXIT_OK: "ok", cli.EXIT_FAILED: "a check failed", cli.EXIT_USAGE: "usage error"}
    audit_only = {audit.EXIT_COULD_NOT_RUN} - set(codes)
    assert audit_only == {3}
    for page in (ROOT / "README.md", ROOT / "docs" / "usage.md"):
        sentence = re.search(r"(?i)exit codes:? (.*?)(?:\n\n|\.\s)", page.read_text(), re.DOTALL)
        assert sentence is not None, page.name
        said = " ".join(sentence[1].split())
        for code, meaning in codes.items():
            assert f"{code} {meaning}" in said, f"{page.name}: exit code {code} ({meaning}) missing from {said!r}"
        assert "`audit` also 3" in said, f"{page.name}: audit's exit code 3 missing from {said!r}"
    table = (ROOT / "docs" / "audit.md").read_text()
    listed = {int(c) for c in re.findall(r"^\| (\d) \|", table, re.MULTILINE)}
    assert listed == {audit.EXIT_PASSES, audit.EXIT_DIFFERS, audit.EXIT_USAGE, audit.EXIT_COULD_NOT_RUN}


def test_every_patchset_a_page_shows_validates(tmp_path: Path) -> None:
    from engine.loader import load_patchset

    shown = 0
    for page in PAGES:
        for i, block in enumerate(re.findall(r"^```yaml\n(.*?)^```", page.read_text(), re.MULTILINE | re.DOTALL)):
            if not (re.search(r"^name:", block, re.MULTILINE) and re.search(r"^patches:", block, re.MULTILINE)):
                continue  # a launcher's config or an excerpt, not a whole patchset
            path = tmp_path / f"{page.stem}_{i}.yaml"
            path.write_text(block)
            load_patchset(str(path))
            shown += 1
    assert shown >= 2  # the README's and patchsets.md's


def test_the_keywords_pages_pass_are_the_entry_points() -> None:
    """``PatchsetCallback("qwen3", unverified=...)`` on a page: the callback takes ``unverified``."""
    import inspect

    import engine
    from engine.integrations.transformers import PatchsetCallback

    entry_points = {"PatchsetCallback": PatchsetCallback.__init__, "engine.apply": engine.apply,
                    "engine.plan": engine.plan}
    bad = []
    for page in PAGES:
        text = page.read_text()
        for name, function in entry_points.items():
            takes = set(inspect.signature(function).parameters)
            for call in re.findall(rf"(?<![\w.]){re.escape(name)}\(([^()]*)\)", text):
                used = set(re.findall(r"(?<![\w.])(\w+)=", call))
                if used - takes:
                    bad.append(f"{page.name}: {name}({call}): takes no {sorted(used - takes)}")
    assert not bad, "\n".join(bad)


# --------------------------------------------------------------------------------------
# One vocabulary: the glossary explains each term once; the README links it where the term first appears.

GLOSSARY = ROOT / "docs" / "glossary.md"
#: Each term the README uses, and how the README words it (its first mention in prose links the glossary).
README_TERMS = {
    "patchset": r"patchsets?", "declaration": r"declar(?:e|es|ed|ation|ations)", "plan": r"planner", "kernel": r"kernels?",
    "verified-content": r"verified it", "self-verification": r"verified by `apply`", "tiny-model": r"tiny\s+model",
    "unverified": r"`unverified`", "truth": r"fp64 evaluation", "op": r"op", "audit": r"audit",
    "zero-configuration": r"zero configuration", "scaffold": r"scaffold", "matrix": r"matrix",
}


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", _prose(page.read_text()), re.MULTILINE)}


def test_the_glossary_explains_the_terms_the_issue_names_and_every_op_and_kernel() -> None:
    from engine.kernels.registry import all_providers
    from engine.ops.base import all_ops

    text = GLOSSARY.read_text()
    anchors = _anchors(GLOSSARY)
    for term in ("patchset", "declaration", "op", "kernel", "verified-content", "self-verification",
                 "zero-configuration", "scaffold", "truth", "audit", *README_TERMS):
        assert term in anchors, f"docs/glossary.md has no section {term!r}"
    for name in [*all_ops(), *{p.name for p in all_providers()}]:
        assert f"`{name}`" in text, f"docs/glossary.md does not name {name!r}"


def test_the_readme_links_each_term_to_the_glossary_where_it_first_appears() -> None:
    prose = _prose((ROOT / "README.md").read_text())
    prose = re.sub(r"^#.*$", "", prose, flags=re.MULTILINE)  # headings are not where a term is used
    for anchor, words in README_TERMS.items():
        link = re.search(rf"\[[^\]]*\]\(docs/glossary\.md#{anchor}\)", prose)
        assert link is not None, f"README.md does not link docs/glossary.md#{anchor}"
        before = re.sub(r"\[[^\]]*\]\([^)]*\)|`[^`]*`", "", prose[:link.start()])  # links and code are not prose
        if anchor == "unverified":
            continue  # the setting is code wherever it is named: the link itself is its first mention
        first = re.search(rf"(?i)\b{words}\b", before)
        assert first is None, f"README.md uses {anchor!r} ({before[max(0, first.start() - 40):first.end()]!r}) " \
                              "before it links the glossary"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_to_a_section_lead_to_one(page: Path) -> None:
    missing = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or "#" not in target:
            continue
        file, anchor = target.split("#", 1)
        linked = (page.parent / file).resolve() if file else page
        if linked.suffix == ".md" and linked.exists() and anchor not in _anchors(linked):
            missing.append(target)
    assert not missing, f"{page.name} links to sections that do not exist: {missing}"


# --------------------------------------------------------------------------------------
# docs/usage.md's "What you see while it runs": the progress lines and tables it shows are the code's.

_PROGRESS = re.compile(r"^(verify|audit) (\d+)/(\d+) \(\d+ s\): (.+)$")


def _transcript(command: str) -> list[str]:
    text = (ROOT / "docs" / "usage.md").read_text()
    block = re.search(rf"```console\n\$ [^\n]*{re.escape(command)}[^\n]*\n(.*?)```", text, re.DOTALL)
    assert block is not None, f"docs/usage.md shows no transcript of {command}"
    return block[1].splitlines()


def test_the_progress_transcripts_are_what_the_commands_print() -> None:
    from engine.commands.checkpoint import STEPS
    from engine.planning.tables import TABLE_WIDTH

    verify, audit = _transcript("patch-engine verify llama --gguf"), _transcript("patch-engine audit llama")
    for name, lines in (("verify", verify), ("audit", audit)):
        shown = [m for m in map(_PROGRESS.match, lines) if m]
        assert shown and all(m[1] == name for m in shown), lines
        totals = {int(m[3]) for m in shown}
        assert len(totals) == 1, f"{name}: one total in a run, not {totals}"
        counts = [int(m[2]) for m in shown]
        assert counts == sorted(counts) and counts[0] == 0 and counts[-1] <= totals.pop()
        # the tables: every line of a table within the width the commands print at (sentences are prose)
        table = [line for line in lines if not _PROGRESS.match(line)
                 and not line.startswith(("verify '", "verification ", "audit on ", "patchset ", "perplexity "))]
        assert max(map(len, table)) <= TABLE_WIDTH, name
    # verify's steps are checkpoint.STEPS, in order, each finished line naming its step
    finished = {}
    for m in map(_PROGRESS.match, verify):
        if m:
            finished.setdefault(int(m[2]), m[4])
    assert {int(m[3]) for m in map(_PROGRESS.match, verify) if m} == {len(STEPS)}
    for done, text in finished.items():
        if done:
            assert text.startswith(STEPS[done - 1]), f"verify {done}/{len(STEPS)}: {text!r} is not {STEPS[done - 1]!r}"
    # audit's total: the model, the original's probe and modules, each condition named, each patch
    conditions = re.search(r'PATCH_ENGINE_AUDIT_CONDITIONS="([^"]+)"', (ROOT / "docs" / "usage.md").read_text())
    assert conditions is not None
    named = conditions[1].split(",")
    command = re.search(r"\$ [^\n]*patch-engine audit llama[^\n]*", (ROOT / "docs" / "usage.md").read_text())
    assert command is not None
    patches = command[0].count("--with ")
    assert {int(m[3]) for m in map(_PROGRESS.match, audit) if m} == {3 + len(named) + patches}
    for condition in named:
        assert any(m and m[4] == f"the original under {condition}" for m in map(_PROGRESS.match, audit)), condition
