"""Imports follow docs/architecture.md's arrows: models -> compiler (passes) -> artifact -> runtime ->
server, each layer importing only those below it, and no two modules importing each other at any
depth. Function-level imports count: a circle broken only by importing late is still a circle."""

import ast
from pathlib import Path

import pytest

import kiln

ROOT = Path(kiln.__file__).parent
FORBIDDEN = {
    "kernels": ("kiln.compiler", "kiln.passes", "kiln.runtime", "kiln.models", "kiln.weights", "kiln.llm",
                "kiln.server", "kiln.cache_tools"),
    "models": ("kiln.compiler", "kiln.passes", "kiln.runtime", "kiln.llm", "kiln.server", "kiln.cache_tools"),
    "weights": ("kiln.compiler", "kiln.passes", "kiln.runtime", "kiln.llm", "kiln.server", "kiln.cache_tools"),
    "passes": ("kiln.compiler", "kiln.runtime", "kiln.weights", "kiln.llm", "kiln.server", "kiln.cache_tools"),
    "compiler": ("kiln.runtime", "kiln.llm", "kiln.server", "kiln.cache_tools"),
    "runtime": ("kiln.compiler.trace", "kiln.compiler.compile", "kiln.compiler.split", "kiln.compiler.workers",
                "kiln.passes", "kiln.llm", "kiln.server", "kiln.cache_tools"),
    "server": ("kiln.compiler.trace", "kiln.compiler.compile", "kiln.compiler.split", "kiln.passes",
               "kiln.cache_tools"),
    "llm.py": ("kiln.kernels", "kiln.cache_tools", "kiln.server", "kiln.compiler.trace", "kiln.compiler.split"),
}
ALLOWED = {
    ("kiln.compiler.compile", "kiln.runtime.bind"):
        "a CUDA compile runs its artifact once to build the Triton kernels it ships",
}
"""(module, import) pairs the table forbids but the design wants, and why."""


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[str]:
    """Every kiln module `path` imports, at any level (not under `if TYPE_CHECKING`): `from p import m`
    names module p.m where m is a module, else p."""
    tree = ast.parse(path.read_text())
    skipped = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
               for child in node.body for n in ast.walk(child)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "kiln"]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "kiln":
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append(sub if sub in MODULES else node.module)
    return found


MODULES = {_module(p): p for p in ROOT.rglob("*.py")}


@pytest.mark.parametrize("where", FORBIDDEN)
def test_no_upstream_imports(where):
    files = [ROOT / where] if where.endswith(".py") else list((ROOT / where).rglob("*.py"))
    bad = [(_module(f), m) for f in files for m in _imports(f)
           if m.startswith(FORBIDDEN[where]) and (_module(f), m) not in ALLOWED]
    assert not bad


def test_no_import_circles():
    graph = {name: set(_imports(path)) & MODULES.keys() for name, path in MODULES.items()}
    circles, index, low, stack, on_stack = [], {}, {}, [], set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not circles


def test_the_layering_test_sees_a_circle(tmp_path, monkeypatch):
    """The circle check on a planted pair of modules, one importing the other inside a function."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from kiln.b import x\n")
    b.write_text("def f():\n    from kiln.a import y\n")
    monkeypatch.setitem(MODULES, "kiln.a", a)
    monkeypatch.setitem(MODULES, "kiln.b", b)
    with pytest.raises(AssertionError):
        test_no_import_circles()
