"""No import circle inside the package: no module of python/openwam_sdpa
imports a module that, directly or through others, imports it back.

Read from the source (every import statement, those inside functions and
`if __name__ == "__main__":` blocks included), not from sys.modules: a
circle that a lazy import hides at run time is still one to untangle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "openwam_sdpa"
SOURCE = Path(__file__).resolve().parents[1] / "python" / PACKAGE


def module_name(path: Path) -> str:
    return PACKAGE if path.stem == "__init__" else f"{PACKAGE}.{path.stem}"


def imported_modules(tree: ast.AST, modules: set[str], this: str) -> set[str]:
    """The package's modules that `this` module's source imports. `from . import
    name` imports the submodule `name` where there is one, else the package
    (its __init__); only what is in `modules` counts."""
    package = this if this == PACKAGE else this.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{base}.{node.module}" if node.module else base
            else:
                base = node.module or ""
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != this)
    return found


def import_graph(sources: dict[str, str], compiled=()) -> dict[str, set[str]]:
    """module name -> the package's modules it imports, from module name ->
    source; `compiled`: the package's extension modules (they import nothing
    of it)."""
    modules = set(sources) | set(compiled)
    graph = {name: set() for name in compiled}
    graph.update((name, imported_modules(ast.parse(text), modules, name))
                 for name, text in sources.items())
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """For each module that reaches itself again, one path that does it."""
    found = []
    for start in sorted(graph):
        path, seen = [start], set()

        def walk(node) -> bool:
            for nxt in sorted(graph[node]):
                if nxt == start:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    path.append(nxt)
                    if walk(nxt):
                        return True
                    path.pop()
            return False

        if walk(start):
            found.append(path + [start])
    return found


def package_sources() -> dict[str, str]:
    return {module_name(p): p.read_text() for p in sorted(SOURCE.glob("*.py"))}


def compiled_modules() -> set[str]:
    # _C.cpython-311-x86_64-linux-gnu.so and the like, where the build put one
    return {f"{PACKAGE}.{p.name.split('.')[0]}" for ext in ("so", "pyd")
            for p in SOURCE.glob(f"*.{ext}")} | {f"{PACKAGE}._C"}


def test_the_package_has_no_import_circle():
    sources = package_sources()
    assert {f"{PACKAGE}.cli", f"{PACKAGE}.doctor", PACKAGE} <= set(sources), sorted(sources)
    graph = import_graph(sources, compiled_modules())
    # The graph is read right: the edges the package is built on are in it.
    assert f"{PACKAGE}.doctor" in graph[f"{PACKAGE}.cli"]
    assert f"{PACKAGE}.ops" in graph[PACKAGE]
    assert graph[f"{PACKAGE}._extension"] == {f"{PACKAGE}._C"}  # `from . import _C`
    assert circles(graph) == [], " ; ".join(" -> ".join(c) for c in circles(graph))


def test_a_circle_is_found():
    """The check can fail: an import inside a function or a __main__ block
    closes a circle as much as one at the top does."""
    sources = {
        PACKAGE: "from .a import f\n",
        f"{PACKAGE}.a": "from . import b\n",
        f"{PACKAGE}.b": "def g():\n    from .c import h\n",
        f"{PACKAGE}.c": "import torch\nif __name__ == '__main__':\n    from openwam_sdpa import a\n",
        f"{PACKAGE}.d": "from . import __version__\n",
    }
    graph = import_graph(sources)
    assert graph[f"{PACKAGE}.d"] == {PACKAGE}  # a name of the package: its __init__
    assert circles(graph) == [
        [f"{PACKAGE}.a", f"{PACKAGE}.b", f"{PACKAGE}.c", f"{PACKAGE}.a"],
        [f"{PACKAGE}.b", f"{PACKAGE}.c", f"{PACKAGE}.a", f"{PACKAGE}.b"],
        [f"{PACKAGE}.c", f"{PACKAGE}.a", f"{PACKAGE}.b", f"{PACKAGE}.c"],
    ]
