"""Packed weights on huge pages: mapped on a 2 MB boundary, left on ordinary pages until written and
queued, then collapsed with their contents intact, here or by the background thread."""

import mmap
import os
from pathlib import Path

import pytest
import torch

from kiln.kernels import gemms, panel_linear
from kiln.weights import formats, huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text() or not hasattr(mmap, "MADV_HUGEPAGE"),
                                reason="no transparent huge pages here")

SHAPE = (4 * huge_pages.HUGE_PAGE // 4 + 1000,)  # four whole huge pages of fp32 and a tail
COLLAPSES = tuple(int(x) for x in os.uname().release.split(".")[:2]) >= (6, 1)  # MADV_COLLAPSE
needs_collapse = pytest.mark.skipif(not COLLAPSES, reason="MADV_COLLAPSE needs Linux 6.1+")


def settle() -> None:
    """Collapse what is queued here, and wait for the background thread if a test started it."""
    huge_pages.collapse_pending()
    huge_pages.wait(timeout=60)


def huge_bytes(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds `tensor` (/proc/self/smaps), in bytes."""
    address, inside = tensor.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def test_empty_maps_on_a_huge_page_boundary():
    t = huge_pages.empty(SHAPE, torch.float32)
    assert t.shape == SHAPE and t.dtype == torch.float32 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    t.fill_(3.0)
    assert torch.equal(t, torch.full(SHAPE, 3.0))
    assert t.untyped_storage().nbytes() == 4 * SHAPE[0] + huge_pages.HUGE_PAGE  # its own mapping, with slack
    small = huge_pages.empty((1000,), torch.float32)  # under one huge page: torch's own allocation
    assert small.shape == (1000,) and small.untyped_storage().nbytes() == 4000


@needs_collapse
def test_written_and_queued_tensors_collapse_with_their_contents():
    t = huge_pages.empty(SHAPE, torch.float32).normal_()
    expected = t.clone()
    assert huge_bytes(t) == 0  # ordinary pages until queued: advised before, it would be faulted in huge
    huge_pages.collapse_later(t)
    settle()
    assert huge_bytes(t) == 4 * huge_pages.HUGE_PAGE  # the whole huge pages; the tail stays on small ones
    assert torch.equal(t, expected)


def test_a_freed_tensor_is_unmapped_and_skipped(monkeypatch):
    advised = []

    class Libc:  # records the calls instead of making them
        def madvise(self, start, length, advice):
            advised.append(start)
            return 0

    monkeypatch.setattr(huge_pages, "_libc", Libc)
    t = huge_pages.empty(SHAPE, torch.float32).zero_()
    start = t.data_ptr()
    with huge_pages._lock:  # the background thread, if a test started it, cannot take it in between
        huge_pages.collapse_later(t)
        [mapping] = [ref for ref, at, _ in huge_pages._pending if at == start]
        del t
        assert mapping() is None  # the last view gone, its mapping is freed with it
    settle()
    assert start not in advised  # never advised once unmapped


@needs_collapse
def test_packed_weights_are_queued_and_the_background_thread_collapses_them():
    w = torch.randn(4096, 512)  # 8 MB: four huge pages
    packed = formats.pack(gemms.PANELS16.id, w)
    codes = formats.pack(gemms.PANELS16_INT8.id, torch.randint(-128, 128, (8192, 512), dtype=torch.int8))  # two
    assert packed.data_ptr() % huge_pages.HUGE_PAGE == 0 and codes.data_ptr() % huge_pages.HUGE_PAGE == 0
    huge_pages.start()
    assert huge_pages.wait(timeout=60)
    assert huge_bytes(packed) == 4 * huge_pages.HUGE_PAGE and huge_bytes(codes) == 2 * huge_pages.HUGE_PAGE
    assert torch.equal(panel_linear.unpack(packed), w)
