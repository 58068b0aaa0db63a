"""The README, docs/ and experiments/ pages name only what exists: every `python -m MODULE` is a module of this checkout or its
environment, every `make TARGET` a target of the Makefile, every `experiment=NAME` a preset, every script path a
file. The commands themselves are run by the tests of what they do (smoke runs, studies, the report)."""
import importlib.util
import re

import pytest

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "experiments").glob("*.md"))]
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
