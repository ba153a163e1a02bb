"""Packed weights kept in a file: packed into it on a miss, published by a rename, mapped with the same
numbers on a hit without packing; keyed by what was packed; repacked, or packed in memory, where the
file cannot serve."""

import gc
import logging
import os
import subprocess
import sys
import time
import weakref

import pytest
import torch

from kiln.kernels import pack_cache, packed_linear, panel_linear
from kiln.kernels.pack_cache import PackFile

IDENTITY = {"checkpoint": [{"file": "/m/model.safetensors", "size": 1, "mtime_ns": 2, "inode": 3}]}


@pytest.fixture
def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"small": torch.randn(64, 32, generator=g),
            "big": torch.randn(2048, 1024, generator=g),  # 8 MB: whole 2 MB pages past the header
            "codes": torch.randint(-127, 128, (32, 64), dtype=torch.int8, generator=g)}


def slots(weights: dict[str, torch.Tensor]) -> list[pack_cache.Slot]:
    return [pack_cache.slot("small", "panels16", weights["small"]), pack_cache.slot("big", "panels16", weights["big"]),
            pack_cache.slot("codes", "panels16_int8", weights["codes"])]


def pack_all(packs: PackFile, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {name: packs.pack(name, "panels16", weights[name]) for name in ("small", "big")}
    out["codes"] = packs.pack("codes", "panels16_int8", weights["codes"])
    packs.publish()
    packs.wait()
    return out


def test_a_miss_packs_into_the_file_and_a_hit_maps_it_without_packing(tmp_path, weights, monkeypatch):
    first = PackFile(tmp_path, IDENTITY, slots(weights))
    assert not first.hit and not first.path.exists()
    packed = pack_all(first, weights)
    assert first.path.is_file() and not list(tmp_path.glob("*.tmp"))
    assert first.mapped_bytes == first.path.stat().st_size > sum(w.nbytes for w in weights.values())
    assert torch.equal(packed["big"], panel_linear.pack(weights["big"]))
    assert torch.equal(panel_linear.unpack_int8(packed["codes"]), weights["codes"])

    def no_packing(*args, **kwargs):
        raise AssertionError("a hit packs nothing")

    monkeypatch.setattr(packed_linear, "pack", no_packing)
    second = PackFile(tmp_path, IDENTITY, slots(weights))
    assert second.hit and second.path == first.path
    for name, fmt in (("small", "panels16"), ("big", "panels16"), ("codes", "panels16_int8")):
        mapped = second.pack(name, fmt, weights[name])
        assert torch.equal(mapped, packed[name]) and mapped.data_ptr() != packed[name].data_ptr()


def test_the_key_covers_the_checkpoint_and_what_is_packed(tmp_path, weights):
    base = PackFile(tmp_path, IDENTITY, slots(weights)).key
    moved = {"checkpoint": [dict(IDENTITY["checkpoint"][0], mtime_ns=5)]}
    assert PackFile(tmp_path, moved, slots(weights)).key != base
    assert PackFile(tmp_path, IDENTITY | {"quantization": "int8"}, slots(weights)).key != base
    assert PackFile(tmp_path, IDENTITY, slots(weights)[:2]).key != base
    assert PackFile(tmp_path, IDENTITY, slots(weights)).key == base


def test_a_weight_without_a_slot_packs_in_memory(tmp_path, weights):
    packs = PackFile(tmp_path, IDENTITY, slots(weights)[:1])
    other = packs.pack("big", "panels16", weights["big"])
    assert torch.equal(other, panel_linear.pack(weights["big"]))
    assert pack_cache.slot("w", "onednn", weights["big"]) is None  # an opaque layout has no slot


def test_a_file_that_does_not_match_its_key_is_packed_again(tmp_path, weights, caplog):
    pack_all(PackFile(tmp_path, IDENTITY, slots(weights)), weights)
    path = PackFile(tmp_path, IDENTITY, slots(weights)).path
    with open(path, "r+b") as f:  # a truncated file, as a disk that filled up might leave
        f.truncate(path.stat().st_size - 4096)
    with caplog.at_level(logging.WARNING, logger="kiln"):
        again = PackFile(tmp_path, IDENTITY, slots(weights))
    assert not again.hit and "does not match its key" in caplog.text
    packed = pack_all(again, weights)
    assert torch.equal(packed["small"], panel_linear.pack(weights["small"]))
    assert PackFile(tmp_path, IDENTITY, slots(weights)).hit


def test_a_cache_that_cannot_be_written_packs_in_memory(tmp_path, weights, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="kiln"):
        packs = PackFile(blocked, IDENTITY, slots(weights))
    assert "packing them in memory" in caplog.text and packs.mapped_bytes == 0
    packed = pack_all(packs, weights)
    assert torch.equal(packed["big"], panel_linear.pack(weights["big"]))


def test_without_huge_pages_the_file_is_not_used(tmp_path, weights, monkeypatch):
    pack_all(PackFile(tmp_path / "published", IDENTITY, slots(weights)), weights)
    monkeypatch.setattr(pack_cache, "_pmd_mapped_bytes", lambda address: 0)
    miss = PackFile(tmp_path / "fresh", IDENTITY, slots(weights))
    assert not miss.hit and miss.mapped_bytes == 0 and not list((tmp_path / "fresh").iterdir())
    hit = PackFile(tmp_path / "published", IDENTITY, slots(weights))
    assert hit.hit and hit.mapped_bytes == 0  # copied into memory for `huge_pages`
    assert torch.equal(hit.pack("big", "panels16", weights["big"]), panel_linear.pack(weights["big"]))


def test_a_published_file_is_mapped_on_huge_pages_here(tmp_path, weights):
    """The premise, on this machine's file system: where it fails, packed weights would land on 4 KB
    pages and the cache falls back to memory (the test above)."""
    packs = PackFile(tmp_path, IDENTITY, slots(weights))
    pack_all(packs, weights)
    if packs.mapped_bytes == 0:
        pytest.skip(f"{tmp_path} gives no 2 MB pages to files here")
    hit = PackFile(tmp_path, IDENTITY, slots(weights))
    big = hit.pack("big", "panels16", weights["big"])
    assert pack_cache._pmd_mapped_bytes(big.data_ptr()) >= 2 * 2**20


def test_a_dead_writers_unfinished_file_is_removed(tmp_path, weights):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"0123.{int(dead.stdout)}.tmp"
    live = tmp_path / f"4567.{os.getpid()}.tmp"
    stale.write_bytes(b"x" * 10)
    live.write_bytes(b"y")
    assert [p for p, _, _ in pack_cache.entries(tmp_path)] == [stale]
    PackFile(tmp_path, IDENTITY, slots(weights))
    assert not stale.exists() and live.exists()


def test_location_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(pack_cache.ENV, raising=False)
    assert pack_cache.folder_for(tmp_path) == tmp_path / "packed"
    monkeypatch.setenv(pack_cache.ENV, str(tmp_path / "elsewhere"))
    assert pack_cache.folder_for(tmp_path) == tmp_path / "elsewhere"
    monkeypatch.setenv(pack_cache.ENV, "off")
    assert pack_cache.folder_for(tmp_path) is None


def test_prune_ages_packed_weights_out_and_a_mapped_file_stays_readable(tmp_path, weights):
    from kiln.cache_tools.prune import prune

    folder = tmp_path / pack_cache.FOLDER
    old = PackFile(folder, IDENTITY, slots(weights))
    pack_all(old, weights)
    new = PackFile(folder, IDENTITY | {"quantization": "int8"}, slots(weights))
    pack_all(new, weights)
    hit = PackFile(folder, IDENTITY, slots(weights))
    mapped = hit.pack("big", "panels16", weights["big"])
    day_ago = time.time() - 86400
    os.utime(old.path, (day_ago, day_ago))
    assert prune(tmp_path, older_than=3600, dry_run=True).packed_removed == 1 and old.path.exists()
    report = prune(tmp_path, older_than=3600)
    assert report.packed_removed == 1 and report.freed_bytes == old.mapped_bytes
    assert sorted(folder.iterdir()) == [new.path]
    assert torch.equal(mapped, panel_linear.pack(weights["big"]))  # the removed file, still mapped here
    assert prune(tmp_path, max_size=0).packed_removed == 1 and not list(folder.iterdir())


def test_a_read_only_cache_still_serves_its_files(tmp_path, weights, monkeypatch):
    pack_all(PackFile(tmp_path, IDENTITY, slots(weights)), weights)

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(os, "utime", read_only)
    hit = PackFile(tmp_path, IDENTITY, slots(weights))
    assert hit.hit and torch.equal(hit.pack("small", "panels16", weights["small"]),
                                   panel_linear.pack(weights["small"]))


def test_a_published_file_is_freed_with_its_weights(tmp_path, weights):
    """Waiting for the file at exit holds the writing thread only, not the file's mapping."""
    packs = PackFile(tmp_path, IDENTITY, slots(weights))
    packed = pack_all(packs, weights)
    gone = weakref.ref(packs)
    del packs, packed
    gc.collect()
    assert gone() is None
