"""No import circle among the benchmarks: benchmarks/*.py import the shared
modules (timing, report, stack, hf_training) and never one another in a loop.
Read from the source, every import statement (those inside functions
included), so that a lazy import cannot hide a circle."""

from __future__ import annotations

import ast
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def imports(path, modules):
    """The benchmarks modules that the file at `path` imports."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found & modules


def circle(graph):
    """A list of modules that import one another round to the first, or None."""
    state = {}

    def visit(name, path):
        state[name] = "open"
        for other in sorted(graph[name]):
            if state.get(other) == "open":
                return path[path.index(other):] + [other]
            if other not in state:
                found = visit(other, path + [other])
                if found:
                    return found
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state:
            found = visit(name, [name])
            if found:
                return found
    return None


def graph_of(folder):
    files = {p.stem: p for p in folder.glob("*.py")}
    return {name: imports(path, set(files)) for name, path in files.items()}


def test_the_benchmarks_import_no_circle():
    graph = graph_of(BENCHMARKS)
    assert {"timing", "report", "bench_sdpa"} <= set(graph)
    assert circle(graph) is None, " -> ".join(circle(graph))


def test_a_circle_is_found(tmp_path):
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from c import x\n")
    (tmp_path / "c.py").write_text("import timing\nimport a\n")
    (tmp_path / "timing.py").write_text("")
    assert circle(graph_of(tmp_path)) == ["a", "b", "c", "a"]
