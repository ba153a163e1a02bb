"""Imports follow DESIGN.md's arrows: models and kernels know nothing of the compiler or runtime;
the runtime never imports the tracing/compile path."""

import ast
from pathlib import Path

import pytest

import kiln

ROOT = Path(kiln.__file__).parent
FORBIDDEN = {
    "kernels": ("kiln.compiler", "kiln.passes", "kiln.runtime", "kiln.models", "kiln.llm"),
    "models": ("kiln.compiler", "kiln.passes", "kiln.runtime", "kiln.llm"),
    "passes": ("kiln.runtime", "kiln.llm"),
    "compiler": ("kiln.runtime", "kiln.llm"),
    "runtime": ("kiln.compiler.trace", "kiln.compiler.compile", "kiln.compiler.split", "kiln.passes", "kiln.llm"),
}


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            yield node.module


@pytest.mark.parametrize("package", FORBIDDEN)
def test_no_upstream_imports(package):
    files = list((ROOT / package).rglob("*.py"))
    if not files:
        pytest.skip(f"kiln/{package} has no modules yet")
    bad = [(f.name, m) for f in files for m in _imports(f) if m.startswith(FORBIDDEN[package])]
    assert not bad
