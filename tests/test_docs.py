"""The README, docs/ and experiments/ pages name only what exists: every `python -m MODULE` is a module of this checkout or its
environment, every `make TARGET` a target of the Makefile, every `experiment=NAME` a preset, every script path a
file. The commands themselves are run by the tests of what they do (smoke runs, studies, the report)."""
import importlib.util
import re

import pytest

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "experiments").rglob("*.md"))]
PAGES = [p for p in PAGES if "results" not in p.relative_to(ROOT).parts]  # the reports are written, not edited
TARGETS = set(re.findall(r"^([A-Za-z0-9_-]+):", (ROOT / "Makefile").read_text(), re.M))
PRESETS = {p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")} | {"null"}


def commands(text: str) -> list[str]:
    """Every line of a bash block, and every inline `code` span that starts as a command does."""
    lines = [line for block in re.findall(r"```bash\n(.*?)```", text, re.S) for line in block.splitlines()]
    spans = [s for s in re.findall(r"`([^`\n]+)`", text) if re.match(r"(\w+=\S+ )*(python|make|bash)\b", s)]
    return [line.split("#")[0].strip() for line in lines + spans if line.split("#")[0].strip()]


def named(command: str) -> list[tuple[str, str]]:
    """(kind, name) of each module, make target, preset and file the command names."""
    out = [("module", m) for m in re.findall(r"python -m ([\w.]+)", command)]
    out += [("target", t) for t in re.findall(r"(?:^|\s)make ([a-z][\w-]*)", command)]
    out += [("preset", p) for p in re.findall(r"experiment=([\w-]+)", command)]
    out += [("file", f) for f in re.findall(r"(?:^|\s)((?:src|experiments|\.ci)/[\w./-]+\.(?:py|sh)|\.ci/run)", command)]
    return out


CASES = sorted({(page.name, kind, name) for page in PAGES for c in commands(page.read_text()) for kind, name in named(c)})


def test_the_pages_name_commands():
    assert len(CASES) > 40, CASES  # the extraction found the pages' commands


@pytest.mark.parametrize("page,kind,name", CASES)
def test_what_a_page_names_exists(page, kind, name):
    if kind == "module":
        assert importlib.util.find_spec(name) is not None, f"{page}: python -m {name}: no such module"
    elif kind == "target":
        assert name in TARGETS, f"{page}: make {name}: no such target in the Makefile"
    elif kind == "preset":
        assert name in PRESETS, f"{page}: experiment={name}: no conf/experiment/{name}.yaml"
    else:
        assert (ROOT / name).is_file(), f"{page}: {name}: no such file"


def test_a_wrong_name_is_caught():
    assert named("python -m batchrnn.nothing && make nothing experiment=nothing src/nothing.py") == [
        ("module", "batchrnn.nothing"), ("target", "nothing"), ("preset", "nothing"), ("file", "src/nothing.py")]
    assert importlib.util.find_spec("batchrnn.nothing") is None and "nothing" not in TARGETS | PRESETS


def links(page) -> list[str]:
    """The page's relative links, without their #anchor."""
    return [t.split("#")[0] for t in re.findall(r"\]\(([^)\s]+)\)", page.read_text())
            if not re.match(r"(https?:|mailto:|#)", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_of_a_page_leads_to_a_file(page):
    missing = [t for t in links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.relative_to(ROOT)}: no such file: {missing}"


def paragraphs(lines: list[str]) -> list[list[str]]:
    """Runs of prose lines between blank lines, leaving out code blocks, tables, lists and headings."""
    out, current, fenced = [], [], False
    for line in lines + [""]:
        if line.startswith("```"):
            fenced = not fenced
        prose = not fenced and line.strip() and not line.startswith(("```", "|", "#", "- ", "  ", "!["))
        if prose:
            current.append(line)
        elif current:
            out, current = out + [current], []
    return out


def test_the_readme_answers_on_its_first_screen():
    """The two set-up-free commands, then an answer block of at most five lines, then the table within the first
    60 lines; no paragraph of the first screen over six lines, and every command it names exists."""
    lines = (ROOT / "README.md").read_text().splitlines()
    opening = lines.index("```bash")
    closing = lines.index("```", opening + 1)
    assert [c.split("#")[0].strip() for c in lines[opening + 1:closing]] == ["make reproduce-an4", "make test"]
    answer = []
    for line in lines[closing + 1:]:
        if answer and not line.startswith(">"):
            break
        if line.startswith(">"):
            answer.append(line)
    assert 1 <= len(answer) <= 5 and lines.index(answer[0]) == closing + 2, answer
    table = next(i for i, line in enumerate(lines) if line.startswith("|"))
    assert table < 60, f"the first table starts at line {table + 1}"
    screen = lines[:60]
    assert all(len(p) <= 6 for p in paragraphs(screen)), [p[0] for p in paragraphs(screen) if len(p) > 6]
    named_here = [n for c in commands("\n".join(screen)) for n in named(c)]
    assert ("target", "reproduce-an4") in named_here and ("target", "test") in named_here
    assert all(n in TARGETS for kind, n in named_here if kind == "target"), named_here


def test_a_long_paragraph_and_a_broken_link_are_caught(tmp_path):
    assert [len(p) for p in paragraphs(["a", "b", "", "| t |", "c", "```bash", "x", "```"])] == [2, 1]
    page = tmp_path / "page.md"
    page.write_text("[gone](gone.md) [here](page.md#top) [web](https://example.org)")
    assert links(page) == ["gone.md", "page.md"]


INDEX = ROOT / "experiments" / "README.md"


def test_the_experiments_index_links_every_page():
    linked = {(INDEX.parent / t).resolve() for t in links(INDEX)}
    pages = {p.resolve() for p in (ROOT / "experiments").rglob("*.md") if p != INDEX and "results" not in p.parts}
    assert pages and not pages - linked, sorted(str(p.relative_to(ROOT)) for p in pages - linked)


def test_each_results_page_is_short_and_in_espnets_shape():
    """The index's "Results" section lists one page per study: at most 120 lines, with the commands that rebuild its
    table, the table, the environment and a reading."""
    section = INDEX.read_text().split("## Results", 1)[1].split("\n## ", 1)[0]
    results = [INDEX.parent / t for t in re.findall(r"\]\(([\w.]+\.md)\)", section)]
    assert len(results) >= 2, section
    for page in results:
        text = page.read_text()
        assert len(text.splitlines()) <= 120, f"{page.name}: {len(text.splitlines())} lines"
        for heading in ("## Commands", "## Table", "## Environment", "## Reading"):
            assert heading in text, f"{page.name}: no {heading}"
