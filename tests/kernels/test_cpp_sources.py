"""kiln's C++ lives in kiln/kernels/csrc, not in Python strings: the wheel ships it, `cpp_source.read`
gives each compiler one translation unit, and editing it rekeys compiled code. That a library built
from it loads with no compiler: tests/compiler/test_artifact.py::test_serves_from_artifact_with_no_compiler."""

import ast
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import kiln
from kiln.compiler import key
from kiln.kernels import cpp_source, decode_attention, greedy_screen, panel_linear

ROOT = Path(kiln.__file__).parent
REPO = ROOT.parent
CSRC = ROOT / "kernels" / "csrc"
CPP_FILES = sorted(p for p in CSRC.iterdir() if p.suffix in (".cpp", ".h"))
CPP_MARKERS = ("#include", "#pragma", 'extern "C"', "AOTI_", "AtenTensorHandle")
SOURCES = {"panel_linear": panel_linear.SOURCE, "panel_int8_linear": panel_linear.INT8_SOURCE,
           "decode_attention": decode_attention.SOURCE, "greedy_screen": greedy_screen.SOURCE}
WRAPPER_SOURCES = {"panel_linear": panel_linear.WRAPPER_SOURCE, "panel_int8_linear": panel_linear.INT8_WRAPPER_SOURCE,
                   "decode_attention": decode_attention.WRAPPER_SOURCE, "greedy_screen": greedy_screen.WRAPPER_SOURCE}


def test_wheel_ships_every_cpp_file(tmp_path):
    # built from a copy of what the wheel is made of: the working tree stays free of build/ and egg-info
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(ROOT, src / "kiln", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist")], cwd=src, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [wheel] = (tmp_path / "dist").glob("kiln-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert CPP_FILES and {f"kiln/kernels/csrc/{p.name}" for p in CPP_FILES} <= names
    assert "kiln/kernels/cpp_source.py" in names


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the docstring nodes of `tree`'s module, classes and functions (prose, not source)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def test_no_cpp_in_python_strings():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == ROOT / "kernels" / "cpp_source.py":  # the reader: its pattern names the include directive
            continue
        tree = ast.parse(path.read_text(), str(path))
        prose = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in prose:
                found += [(str(path.relative_to(REPO)), node.lineno, m) for m in CPP_MARKERS if m in node.value]
    assert not found


def test_read_splices_each_local_include():
    for name, source in {**SOURCES, **WRAPPER_SOURCES}.items():
        assert not re.search(r'^\s*#include\s*"', source, re.MULTILINE), name
    assert panel_linear.SOURCE == cpp_source.read("panel_linear.cpp")
    assert cpp_source.read("panel.h") in panel_linear.SOURCE and cpp_source.read("panel.h") in panel_linear.INT8_SOURCE
    assert greedy_screen.SOURCE.count("static void kiln_panel_int8_rows(") == 1  # the int8 GEMM, spliced in
    assert all(cpp_source.read("aoti_shim.h") in source for source in WRAPPER_SOURCES.values())
    for name, source in WRAPPER_SOURCES.items():
        assert source.count(f"aoti_torch_cpu_kiln_{name}(") == 1  # only the definition: the wrapper counts calls
    assert f"AOTITorchError {decode_attention.SHIM}(" in decode_attention.WRAPPER_SOURCE
    assert f"AOTITorchError {greedy_screen.SHIM}(" in greedy_screen.WRAPPER_SOURCE
    for kernel in (panel_linear.FLOAT, panel_linear.INT8):
        assert f'extern "C" void {kernel.entry}(' in kernel.source
        assert f"AOTITorchError {kernel.shim}(" in kernel.wrapper_source


def test_headers_spliced_twice_keep_themselves_once():
    # both panel GEMMs, and several kernels' shims, may land in one wrapper
    for header in (p.name for p in CPP_FILES if p.suffix == ".h"):
        text = cpp_source.read(header)
        guard = re.search(r"^#ifndef (\w+)\n#define \1\n", text, re.MULTILINE)
        assert guard and text.rstrip().endswith("#endif  // " + guard.group(1)), header


def _define(name: str) -> int:
    return int(re.search(rf"^#define {name} (\d+)$", cpp_source.read("panel.h"), re.MULTILINE).group(1))


def test_python_constants_are_the_kernels():
    assert _define("KILN_PANEL") == panel_linear.PANEL
    assert _define("KILN_PREFETCH_LINES") == panel_linear.PREFETCH_LINES


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
@pytest.mark.parametrize("name", SOURCES)
def test_kernel_source_is_a_translation_unit_of_its_own(name, tmp_path):
    """What the timing build compiles, and what a wrapper gets before its shim: nothing from the wrapper needed."""
    source = tmp_path / f"{name}.cpp"
    source.write_text(SOURCES[name])
    proc = subprocess.run(["g++", "-fsyntax-only", "-fopenmp", "-mavx512f", "-mavx512vnni", "-Wall", str(source)],
                          capture_output=True, text=True)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr[-3000:]


def test_editing_the_cpp_rekeys(tmp_path, monkeypatch):
    kernels = tmp_path / "kiln" / "kernels"
    (kernels / "csrc").mkdir(parents=True)
    (tmp_path / "kiln" / "__init__.py").write_text("")
    (kernels / "csrc" / "kernel.cpp").write_text("int x;\n")
    monkeypatch.setattr(key.kiln, "__file__", str(tmp_path / "kiln" / "__init__.py"))
    before = key.kiln_source_hash.__wrapped__()
    (kernels / "csrc" / "kernel.cpp").write_text("int y;\n")
    assert key.kiln_source_hash.__wrapped__() != before
