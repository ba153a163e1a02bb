"""The LM head's panel GEMMs as the artifact ships them: one library per format, built from a graph of
the one op with the row count dynamic, calling the kernel from C++ (no proxy call), with the op's
numbers at any row count; a second build of the same head comes from the piece cache."""

import pytest
import torch

from kiln.compiler import libraries, workers
from kiln.compiler.aoti import LoadedLibrary
from kiln.compiler.piece_cache import PieceCache
from kiln.kernels import cpp_lowering, panel_linear
from tests.kernels.test_cpp_lowering import _codes

pytestmark = pytest.mark.skipif(
    not cpp_lowering.register() or panel_linear.available((96, 40), torch.int8) is not None,
    reason="kiln's panel GEMMs are not available on this CPU and torch (the int8 one needs AVX512-VNNI)")


def test_head_libraries_run_the_panel_gemms_at_any_row_count(tmp_path, monkeypatch):
    cache = PieceCache(tmp_path / "pieces")
    built = libraries.build_head(["panels16", "panels16_int8"], (96, 40), cache)
    assert sorted(built) == ["panels16", "panels16_int8"]
    for format, compiled in built.items():
        assert compiled.calls is None  # the kernel is in the library, not a proxy call
        source = "\n".join(compiled.sources.values())
        assert source.count("void kiln_panel_int8_gemm(" if format == "panels16_int8" else "void kiln_panel_gemm(") == 1
        (tmp_path / f"{format}.so").write_bytes(compiled.library)
    fp32, int8 = (LoadedLibrary(tmp_path / f"{f}.so", (0, 1)) for f in ("panels16", "panels16_int8"))
    w, codes = torch.randn(96, 40), _codes(96, 40)
    for rows in (1, 7, 16, 40):
        x, a = torch.randn(rows, 40), _codes(rows, 40)
        [out] = fp32(x, panel_linear.pack(w))
        torch.testing.assert_close(out, x @ w.t(), rtol=1e-4, atol=1e-4)
        [out] = int8(a, panel_linear.pack_int8(codes))
        assert torch.equal(out, torch._int_mm(a, codes.t()).float())
    monkeypatch.setattr(workers, "compile_jobs",
                        lambda jobs, names=None: pytest.fail("compiled again") if jobs else iter(()))
    again = libraries.build_head(["panels16_int8"], (96, 40), cache)
    assert again["panels16_int8"].library == built["panels16_int8"].library
