"""The piece cache: what its key sees and ignores, entries kept whole, pruning."""

import os
import time

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from kiln.cache_tools.prune import prune
from kiln.compiler.aoti import CompiledLibrary
from kiln.compiler.compile import normalize
from kiln.compiler.piece_cache import ENV, FOLDER, PieceCache, piece_cache_key


def _graph() -> fx.GraphModule:
    return normalize(fx.symbolic_trace(lambda x, w: torch.relu(torch.mm(x, w))))


def _examples(rows: int = 5, cols: int = 8, dtype=torch.float32, burn: int = 0, ranged: bool = False) -> list:
    """Fake (x, w) with x's row count symbolic; `burn` symbols are made first, so the same shapes get
    other symbol numbers."""
    env = ShapeEnv()
    mode = FakeTensorMode(shape_env=env)
    dynamic = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC], constraint_sizes=[None] * 2)
    for _ in range(burn):
        mode.from_tensor(torch.empty(3 + _, 2), symbolic_context=dynamic)
    x = mode.from_tensor(torch.empty(rows, cols, dtype=dtype), symbolic_context=dynamic)
    w = mode.from_tensor(torch.empty(cols, 4, dtype=dtype))
    if ranged:
        torch._check(x.shape[0] <= 64)
    return [x, w]


def test_key_ignores_symbol_numbering_and_sees_inputs():
    graph = _graph()
    base = piece_cache_key(graph, _examples())
    assert piece_cache_key(graph, _examples(burn=2)) == base  # x's rows are s2, not s0: the same compile
    assert piece_cache_key(graph, _examples(rows=9)) == base  # another hint of the same symbolic size
    assert piece_cache_key(graph, _examples(cols=16)) != base
    assert piece_cache_key(graph, _examples(dtype=torch.bfloat16)) != base
    assert piece_cache_key(graph, _examples(ranged=True)) != base  # Inductor may use a symbol's range
    other = normalize(fx.symbolic_trace(lambda x, w: torch.sigmoid(torch.mm(x, w))))
    assert piece_cache_key(other, _examples()) != base


def _library(tag: bytes) -> CompiledLibrary:
    return CompiledLibrary(b"\x7fELF" + tag, b'{"nodes": []}', {"wrapper.cpp": "// " + tag.decode()})


def test_entries_round_trip_and_damage_reads_as_a_miss(tmp_path):
    cache = PieceCache(tmp_path)
    assert cache.get("k" * 32) is None
    cache.put("k" * 32, _library(b"one"))
    assert cache.get("k" * 32) == _library(b"one")
    assert [p.name for p in tmp_path.iterdir()] == ["k" * 32]  # no temporary folder left behind
    cache.put("k" * 32, _library(b"two"))  # a concurrent compile stored it first: the first stays
    assert cache.get("k" * 32) == _library(b"one")
    PieceCache(tmp_path, read=False).put("k" * 32, _library(b"two"))  # --force: the new compile replaces it
    assert cache.get("k" * 32) == _library(b"two") and PieceCache(tmp_path, read=False).get("k" * 32) is None
    library = tmp_path / ("k" * 32) / "library.so"
    library.write_bytes(library.read_bytes()[:-1] + b"!")  # one byte flipped
    assert cache.get("k" * 32) is None and not (tmp_path / ("k" * 32)).exists()  # removed, to be written again
    cache.put("k" * 32, _library(b"one"))
    (tmp_path / ("k" * 32) / "entry.json").write_text("{trunc")
    assert cache.get("k" * 32) is None
    cache.put("k" * 32, _library(b"one"))
    assert cache.get("k" * 32) == _library(b"one")
    calls_free = CompiledLibrary(b"lib", None, {})
    cache.put("c" * 32, calls_free)
    assert cache.get("c" * 32) == calls_free


def test_location_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert PieceCache.for_cache_dir(tmp_path).root == tmp_path / FOLDER
    monkeypatch.setenv(ENV, str(tmp_path / "elsewhere"))
    assert PieceCache.for_cache_dir(tmp_path).root == tmp_path / "elsewhere"
    monkeypatch.setenv(ENV, "off")
    assert PieceCache.for_cache_dir(tmp_path) is None


def test_prune_drops_unused_pieces_first(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    cache = PieceCache.for_cache_dir(tmp_path)
    cache.put("a" * 32, _library(b"old" * 1000))
    cache.put("b" * 32, _library(b"new" * 1000))
    day_ago = time.time() - 86400
    os.utime(cache.root / ("a" * 32), (day_ago, day_ago))
    report = prune(tmp_path, older_than=3600, dry_run=True)
    assert report.pieces_removed == 1 and (cache.root / ("a" * 32)).exists()
    report = prune(tmp_path, older_than=3600)
    assert report.pieces_removed == 1 and report.freed_bytes > 3000
    assert [p.name for p in cache.root.iterdir()] == ["b" * 32]
    elsewhere = PieceCache(tmp_path / "shared")
    elsewhere.put("c" * 32, _library(b"shared"))
    monkeypatch.setenv(ENV, str(elsewhere.root))  # a piece cache moved out of the cache is not its to prune
    assert prune(tmp_path, max_size=0).pieces_removed == 1 and list(cache.root.iterdir()) == []
    assert elsewhere.get("c" * 32) is not None

