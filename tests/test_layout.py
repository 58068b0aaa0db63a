"""The package's layout: no import circles, and the entry points users' scripts, configs and commands name."""
import ast
import importlib
import subprocess
import sys

import pytest

from conftest import ROOT

PACKAGE = ROOT / "src" / "batchrnn"


def module_name(path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path, modules: set[str]) -> set[str]:
    """The package modules a module imports, anywhere in it (a lazy import inside a function counts too):
    `from a.b import c` is a.b.c where that is a module, else a.b. A package's own __init__ importing its
    modules is no circle, as long as none of them imports from that __init__ in turn."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                found.add(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module)
    return {m for m in found if m in modules}


def graph() -> dict[str, set[str]]:
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    edges = {m: imports_of(p, set(paths)) - {m} for m, p in paths.items()}
    return edges


def find_circle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import circle of the graph, as a path that ends where it starts, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for n in sorted(edges.get(m, ())):
            if state.get(n) == "open":
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(edges):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_no_import_circles():
    edges = graph()
    assert len(edges) > 30 and "batchrnn.layers.base" in edges  # the walk saw the package
    assert (circle := find_circle(edges)) is None, "import circle: " + " -> ".join(circle)


def test_a_planted_circle_is_found():
    edges = graph()
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    edges["batchrnn.config"].add("batchrnn.layers")  # what config.check_variant's lazy import once was
    assert find_circle(edges) is not None


@pytest.mark.parametrize("where,name", [
    ("batchrnn.model", "build_recurrent_layer"), ("batchrnn.model", "DeepSpeech2"),
    ("batchrnn.checkpoint", "load_model"), ("batchrnn.sweep", "SweepStatus"), ("batchrnn.report", "write_report"),
    ("batchrnn.layers", "LAYERS"),
])
def test_public_names_stay_where_users_find_them(where, name):
    assert callable(getattr(importlib.import_module(where), name)) or isinstance(getattr(
        importlib.import_module(where), name), dict)


def test_the_config_names_a_callback_that_exists():
    text = (ROOT / "conf" / "config.yaml").read_text()
    assert "_target_: batchrnn.sweep.SweepStatus" in text


@pytest.mark.parametrize("module", ["batchrnn.data", "batchrnn.study", "batchrnn.report", "batchrnn.evaluate"])
def test_python_dash_m_entry_points_answer_help(module):
    run = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "usage:" in run.stdout, run.stderr[-2000:]


def test_progress_in_a_log_file_is_a_few_whole_lines(capsys):
    """stderr is not a terminal here (pytest captures it), as under nohup, CI or SLURM: no carriage-return
    fragments, only whole lines, at most one per LOG_INTERVAL_S and the last state."""
    from batchrnn.progress import progress_bar

    for _ in progress_bar(range(5000), desc="epoch 1", unit="batch"):
        pass
    err = capsys.readouterr().err
    assert "\r" not in err and err.endswith("\n")
    lines = err.splitlines()
    assert 1 <= len(lines) <= 3 and lines[-1].startswith("epoch 1: 100%") and "5000/5000" in lines[-1], lines


def test_progress_on_a_terminal_is_tqdms_bar():
    import io

    from batchrnn.progress import Lines, progress_bar

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    for _ in progress_bar(range(3), desc="x", file=term, mininterval=0):
        pass
    assert "\r" in term.getvalue()  # redrawn in place
    assert not isinstance(progress_bar(range(1), file=term).fp, Lines)


def test_the_slow_lane_fails_without_its_archive_when_asked_for(tmp_path):
    """`pytest -m slow` with no AN4_ARCHIVE must fail, not skip its way to a green lane."""
    env = {k: v for k, v in __import__("os").environ.items() if k not in ("AN4_ARCHIVE", "CI")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-m", "slow", "-q", "-p", "no:cacheprovider",
                          str(ROOT / "tests" / "test_an4_real.py")], capture_output=True, text=True, env=env,
                         timeout=600, cwd=ROOT)
    assert run.returncode != 0 and "the slow lane was asked for, but AN4_ARCHIVE is not set" in run.stdout, run.stdout
