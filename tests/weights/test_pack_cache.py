"""Packed weights kept in a file: written on a miss, published read-only by a rename, read back with the
same numbers on a hit without packing, every slot checked against its checksum; keyed by what was
packed; repacked where the file is damaged, packed in memory where it cannot be written."""

import gc
import json
import logging
import os
import subprocess
import sys
import time
import weakref

import pytest
import torch

from kiln.kernels import gemms, panel_linear
from kiln.weights import pack_cache
from kiln.weights.pack_cache import PackFile

IDENTITY = {"checkpoint": "0123456789abcdef0123456789abcdef"}


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


def test_a_miss_packs_and_publishes_a_read_only_file_and_a_hit_reads_it_without_packing(tmp_path, weights,
                                                                                    monkeypatch):
    first = PackFile(tmp_path, IDENTITY, slots(weights))
    assert not first.hit and not first.path.exists()
    packed = pack_all(first, weights)
    assert first.path.is_file() and not list(tmp_path.glob("*.tmp"))
    assert first.path.stat().st_mode & 0o777 == 0o444
    assert first.path.stat().st_size > sum(w.nbytes for w in weights.values())
    assert torch.equal(packed["big"], panel_linear.pack(weights["big"]))
    assert torch.equal(panel_linear.unpack_int8(packed["codes"]), weights["codes"])

    def no_packing(*args, **kwargs):
        raise AssertionError("a hit packs nothing")

    monkeypatch.setattr(gemms, "pack", no_packing)
    second = PackFile(tmp_path, IDENTITY, slots(weights))
    read = pack_all(second, weights)
    assert second.hit and second.path == first.path and second.read_bytes == sum(w.nbytes for w in weights.values())
    for name in weights:
        assert torch.equal(read[name], packed[name]) and read[name].data_ptr() != packed[name].data_ptr()


def test_the_key_covers_the_checkpoint_and_what_is_packed(tmp_path, weights):
    base = PackFile(tmp_path, IDENTITY, slots(weights)).key
    assert PackFile(tmp_path, {"checkpoint": "f" * 32}, slots(weights)).key != base
    assert PackFile(tmp_path, IDENTITY | {"quantization": "int8"}, slots(weights)).key != base
    assert PackFile(tmp_path, IDENTITY, slots(weights)[:2]).key != base
    assert PackFile(tmp_path, IDENTITY, slots(weights)).key == base


def test_a_weight_without_a_slot_packs_in_memory(tmp_path, weights):
    packs = PackFile(tmp_path, IDENTITY, slots(weights)[:1])
    other = packs.pack("big", "panels16", weights["big"])
    assert torch.equal(other, panel_linear.pack(weights["big"]))
    assert pack_cache.slot("w", "onednn", weights["big"]) is None  # an opaque layout has no slot


def damage_truncate(path, rng):
    with open(path, "r+b") as f:  # a truncated file, as a disk that filled up might leave
        f.truncate(path.stat().st_size - 4096)


def damage_flip_exponent(path, rng):
    """One exponent bit of one weight of the big slot (the second): a plausible number, wildly wrong."""
    start = int.from_bytes(path.read_bytes()[8:16], "little")
    header = json.loads(path.read_bytes()[16:16 + start])
    assert header["slots"][1]["name"] == "big"
    big = -(-(16 + start) // 4096) * 4096 + 8192  # past the header's page and the small slot's two
    offset = big + 4 * int(rng.integers(0, 2048 * 1024)) + 3  # a float's top byte
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def damage_zero_page(path, rng):
    data = bytearray(path.read_bytes())
    data[3 * 4096:4 * 4096] = bytes(4096)
    path.write_bytes(bytes(data))


def damage_random_megabyte(path, rng):
    data = bytearray(path.read_bytes())
    data[4096:4096 + (1 << 20)] = rng.integers(0, 256, 1 << 20, dtype="uint8").tobytes()
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [damage_truncate, damage_flip_exponent, damage_zero_page, damage_random_megabyte])
def test_a_damaged_file_is_named_and_packed_again(tmp_path, weights, caplog, damage):
    """Each damage from the report, the file's mtime kept (`touch -r`): a warning naming the file and a
    repack, never a wrong weight."""
    import numpy as np

    pack_all(PackFile(tmp_path, IDENTITY, slots(weights)), weights)
    path = PackFile(tmp_path, IDENTITY, slots(weights)).path
    before = path.stat()
    path.chmod(0o644)
    damage(path, np.random.default_rng(0))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    with caplog.at_level(logging.WARNING, logger="kiln"):
        again = PackFile(tmp_path, IDENTITY, slots(weights))
        packed = pack_all(again, weights)
    assert not again.hit and str(path) in caplog.text and "packing again" in caplog.text
    for name in ("small", "big"):
        assert torch.equal(packed[name], panel_linear.pack(weights[name]))
    assert torch.equal(panel_linear.unpack_int8(packed["codes"]), weights["codes"])
    hit = PackFile(tmp_path, IDENTITY, slots(weights))
    assert torch.equal(pack_all(hit, weights)["big"], panel_linear.pack(weights["big"])) and hit.hit


def test_another_keys_data_under_this_header_is_packed_again(tmp_path, weights, caplog):
    """A splice: the slots of another checkpoint's file behind this file's header and checksums."""
    pack_all(PackFile(tmp_path, IDENTITY, slots(weights)), weights)
    other = {k: v + 1 if v.is_floating_point() else v for k, v in weights.items()}
    other_file = PackFile(tmp_path, {"checkpoint": "f" * 32}, slots(other))
    pack_all(other_file, other)
    path = PackFile(tmp_path, IDENTITY, slots(weights)).path
    ours, theirs = path.read_bytes(), other_file.path.read_bytes()
    path.chmod(0o644)
    path.write_bytes(ours[:4096] + theirs[4096:len(theirs) - 48] + ours[len(ours) - 48:])
    with caplog.at_level(logging.WARNING, logger="kiln"):
        again = PackFile(tmp_path, IDENTITY, slots(weights))
        packed = pack_all(again, weights)
    assert not again.hit and "checksum of" in caplog.text and str(path) in caplog.text
    assert torch.equal(packed["big"], panel_linear.pack(weights["big"]))


def test_random_byte_flips_never_serve_a_wrong_weight(tmp_path, weights):
    """200 seeded flips over the whole file: each is caught (a repack of what it hit), or lands in
    padding no weight reads and the weights read back are the packed ones, bit for bit."""
    import numpy as np

    expected = pack_all(PackFile(tmp_path, IDENTITY, slots(weights)), weights)
    path = PackFile(tmp_path, IDENTITY, slots(weights)).path
    path.chmod(0o644)
    original = path.read_bytes()
    rng = np.random.default_rng(43)
    caught = 0
    for _ in range(200):
        offset, bit = int(rng.integers(0, len(original))), int(rng.integers(0, 8))
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(bytes([original[offset] ^ (1 << bit)]))
        packs = PackFile(tmp_path, IDENTITY, slots(weights))
        read = [packs.read(s.name, s.format) for s in packs.slots]
        for s, tensor in zip(packs.slots, read):
            assert tensor is None or torch.equal(tensor, expected[s.name]), (offset, s.name)
        caught += any(tensor is None for tensor in read)
        packs.publish()
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(original[offset:offset + 1])
    assert caught > 150  # padding is a small part of the file


def test_a_running_process_keeps_its_weights_when_the_file_is_edited_or_truncated(tmp_path, weights):
    """Weights of its own: no SIGBUS, no change, whatever happens to the file after it was read."""
    expected = pack_all(PackFile(tmp_path, IDENTITY, slots(weights)), weights)
    hit = PackFile(tmp_path, IDENTITY, slots(weights))
    held = pack_all(hit, weights)
    assert hit.hit
    hit.path.chmod(0o644)
    with open(hit.path, "r+b") as f:
        f.seek(8192)
        f.write(bytes(1 << 20))
        f.truncate(4096)
    for name, tensor in held.items():
        assert torch.equal(tensor, expected[name])


def test_a_cache_that_cannot_be_written_packs_in_memory(tmp_path, weights, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="kiln"):
        packs = PackFile(blocked, IDENTITY, slots(weights))
        packed = pack_all(packs, weights)
    assert not packs.hit and "not kept" in caplog.text
    assert torch.equal(packed["big"], panel_linear.pack(weights["big"]))


def test_a_dead_writers_unfinished_file_is_removed(tmp_path, weights):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"0123.{int(dead.stdout)}.tmp"
    live = tmp_path / f"4567.{os.getpid()}.tmp"
    stale.write_bytes(b"x" * 10)
    live.write_bytes(b"y")
    assert [p for p, _, _ in pack_cache.entries(tmp_path)] == [stale]
    pack_all(PackFile(tmp_path, IDENTITY, slots(weights)), weights)
    assert not stale.exists() and live.exists()


def test_location_follows_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv(pack_cache.ENV, raising=False)
    assert pack_cache.folder_for(tmp_path) == tmp_path / "packed"
    monkeypatch.setenv(pack_cache.ENV, str(tmp_path / "elsewhere"))
    assert pack_cache.folder_for(tmp_path) == tmp_path / "elsewhere"
    monkeypatch.setenv(pack_cache.ENV, "off")
    assert pack_cache.folder_for(tmp_path) is None


def test_prune_ages_packed_weights_out_and_a_reader_keeps_its_weights(tmp_path, weights):
    from kiln.cache_tools.prune import prune

    folder = tmp_path / pack_cache.FOLDER
    old = PackFile(folder, IDENTITY, slots(weights))
    pack_all(old, weights)
    new = PackFile(folder, IDENTITY | {"quantization": "int8"}, slots(weights))
    pack_all(new, weights)
    hit = PackFile(folder, IDENTITY, slots(weights))
    read = pack_all(hit, weights)["big"]
    old_bytes = old.path.stat().st_size
    day_ago = time.time() - 86400
    os.utime(old.path, (day_ago, day_ago))
    assert prune(tmp_path, older_than=3600, dry_run=True).packed_removed == 1 and old.path.exists()
    report = prune(tmp_path, older_than=3600)
    assert report.packed_removed == 1 and report.freed_bytes == old_bytes
    assert sorted(folder.iterdir()) == [new.path]
    assert torch.equal(read, panel_linear.pack(weights["big"]))  # read from the removed file
    assert prune(tmp_path, max_size=0).packed_removed == 1 and not list(folder.iterdir())


def test_a_read_only_cache_still_serves_its_files(tmp_path, weights, monkeypatch):
    pack_all(PackFile(tmp_path, IDENTITY, slots(weights)), weights)

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Read-only file system")

    monkeypatch.setattr(os, "utime", read_only)
    hit = PackFile(tmp_path, IDENTITY, slots(weights))
    assert torch.equal(pack_all(hit, weights)["small"], panel_linear.pack(weights["small"])) and hit.hit


def test_a_published_file_is_freed_with_its_weights(tmp_path, weights):
    """Waiting for the file at exit holds the writing thread only, not the weights."""
    packs = PackFile(tmp_path, IDENTITY, slots(weights))
    packed = pack_all(packs, weights)
    gone = weakref.ref(packs)
    del packs, packed
    gc.collect()
    assert gone() is None
