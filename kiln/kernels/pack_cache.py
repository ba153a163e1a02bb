"""Packed weights kept in a file beside the artifacts, and mapped at a later load straight from the
page cache: on huge pages from the first step, with no packing.

A batch-1 decode step streams every packed weight from memory, and on 4 KB pages that is a TLB miss
every 4 KB. Anonymous memory gets onto 2 MB pages only through `huge_pages`' collapse in idle time,
which a busy process does not have: on the 0.5B shape in fp32, batch-1 decode took 37 ms a token on
4 KB pages and 27 once collapsed (one process, before and after). A file that Linux's page cache
holds in 2 MB folios (ext4 and xfs on Linux 6.x) maps on 2 MB pages as it is first touched. So the
first load packs straight into a new file's shared mapping, and a background thread makes the file
durable (fsync) and publishes it by a rename (a process that exits sooner waits for it); a later load
maps the published file read-only, and processes on one machine share its pages. Where the file
system gives no 2 MB pages, or the cache cannot be written, weights are packed in memory as without
this cache (`huge_pages` collapses them).

A file is keyed by its caller's identity of what it packs (`kiln.LLM`'s: the checkpoint files' path,
size, modification time and inode, not a hash of their bytes, which would cost a second a GB at
every start; the quantization, the tensor-parallel shard, torch's version and kiln's source) and by
the slots (names, formats, shapes). The files live in `<cache>/packed/` (`$KILN_PACK_CACHE` moves them; `off`
turns the cache off); `kiln cache prune` ages them out with the artifacts.
"""

import atexit
import ctypes
import functools
import hashlib
import json
import logging
import math
import mmap
import os
import re
import struct
import threading
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kiln.kernels import huge_pages, packed_linear

logger = logging.getLogger(__name__)

VERSION = 1
"""The file layout's version (part of the key)."""
FOLDER = "packed"
"""Where the files live in a cache directory."""
ENV = "KILN_PACK_CACHE"
SUFFIX = ".bin"
MAGIC = b"KILNPACK"
ALIGN = 4096
"""Each slot's offset in the file: a page."""
_mapped = 0
"""Bytes of packed weights this process maps from files (on 2 MB pages), over all loads."""
MADV_POPULATE_READ = 22
"""Linux 5.14+: map every page of a range now (not among Python 3.11's mmap constants)."""
PROT_READ = 1


def mapped_bytes() -> int:
    """Bytes of packed weights this process maps from files, on 2 MB pages (`huge_pages` counts the
    ones it collapsed)."""
    return _mapped


def folder_for(cache_dir: Path) -> Path | None:
    """Where packed weights are kept for the artifacts in `cache_dir`, or where `$KILN_PACK_CACHE`
    says (None when it says `off`)."""
    where = os.environ.get(ENV, "")
    if where.lower() in ("off", "0", "none"):
        return None
    return Path(where).expanduser() if where else Path(cache_dir) / FOLDER


@dataclass(frozen=True)
class Slot:
    """One packed weight in a file: the weight's name, its format (`packed_linear.PLAIN_FORMATS`),
    shape and dtype."""

    name: str
    format: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize


def slot(name: str, format: str, weight: torch.Tensor) -> Slot | None:
    """The slot a weight packed in `format` takes; None for a format that is not a plain tensor or a
    weight not on the CPU (such weights are packed in memory)."""
    if format not in packed_linear.PLAIN_FORMATS or weight.device.type != "cpu":
        return None
    return Slot(name, format, tuple(weight.shape), str(weight.dtype).removeprefix("torch."))


def cache_key(identity: dict, slots: list[Slot]) -> str:
    """The file name's key: `identity` (whatever tells what the packed bytes came from) and the
    slots, under this layout's version."""
    blob = json.dumps({"version": VERSION, "identity": identity, "slots": [asdict(s) for s in slots]}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class PackFile:
    """The packed weights of one load, in one file under `folder`: mapped from it where it is there
    (`hit`), else packed into a new one (`pack`, then `publish`). A weight with no slot, or every
    weight where the file cannot be used, is packed in memory."""

    def __init__(self, folder: Path, identity: dict, slots: list[Slot]):
        self.slots = list(dict.fromkeys(slots))
        self.key = cache_key(identity, self.slots)
        self.path = Path(folder) / f"{self.key}{SUFFIX}"
        self.hit = False
        self.mapped_bytes = 0
        """Bytes of this process's weights that live in the page cache (which counts them as available)."""
        self._views: dict[tuple[str, str], torch.Tensor] = {}
        self._mapping: mmap.mmap | None = None
        self._fd: int | None = None
        self._tmp: Path | None = None
        self._publisher: threading.Thread | None = None
        if not self.slots:
            return
        start = time.perf_counter()
        try:
            self.hit = self._map_published()
            if self.hit:
                logger.info("mapped %d packed weights (%.2f GB) from %s in %.2fs", len(self.slots),
                            self.mapped_bytes / 1e9, self.path, time.perf_counter() - start)
            else:
                self._create()
        except OSError as e:
            logger.warning("packed weights not cached in %s (%s): packing them in memory", folder, e)
            self._abandon()

    def pack(self, name: str, format: str, weight: torch.Tensor) -> torch.Tensor:
        """`weight` packed in `format`: the file's copy on a hit, else packed into the file's slot, or
        into memory where it has none."""
        view = self._views.get((name, format))
        if view is None:
            return packed_linear.pack(format, weight)
        if self.hit:
            return view
        return packed_linear.pack(format, weight, out=view)

    def publish(self) -> None:
        """Once every slot is packed (after a miss): the mapping made read-only, and the file made
        durable and renamed into place by a background thread, which exit waits for."""
        if self.hit or self._tmp is None:
            return
        address = ctypes.addressof(ctypes.c_char.from_buffer(self._mapping))
        _libc().mprotect(address, len(self._mapping), PROT_READ)  # nothing writes a packed weight

        def durable() -> None:
            started = time.perf_counter()
            try:
                os.fsync(self._fd)
                os.replace(self._tmp, self.path)
                directory = os.open(self.path.parent, os.O_RDONLY)
                try:
                    os.fsync(directory)
                finally:
                    os.close(directory)
                logger.info("wrote %.2f GB of packed weights to %s in %.2fs", self.mapped_bytes / 1e9, self.path,
                            time.perf_counter() - started)
            except OSError as e:
                logger.warning("packed weights not cached in %s (%s)", self.path.parent, e)
                self._tmp.unlink(missing_ok=True)
            finally:
                os.close(self._fd)  # the mapping stays: it holds the pages, not the descriptor

        self._publisher = threading.Thread(target=durable, name="kiln-pack-cache", daemon=True)
        self._publisher.start()
        atexit.register(_finish, self._publisher, self.path)  # the thread only: the mapping goes with its views

    def wait(self) -> None:
        """Wait until a file being published is in place."""
        if self._publisher is not None:
            _finish(self._publisher, self.path)

    # ---- the file ----

    def _layout(self) -> tuple[bytes, list[int], int]:
        """(the header, each slot's offset, the file's size)."""
        entries = [asdict(s) for s in self.slots]
        header = json.dumps({"version": VERSION, "key": self.key, "slots": entries}).encode()
        offset = _align(len(MAGIC) + 8 + len(header))
        offsets = []
        for s in self.slots:
            offsets.append(offset)
            offset = _align(offset + s.nbytes)
        return MAGIC + struct.pack("<Q", len(header)) + header, offsets, offset

    def _map_published(self) -> bool:
        header, offsets, size = self._layout()
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            if os.fstat(fd).st_size != size or os.pread(fd, len(header), 0) != header:
                logger.warning("packed weights file %s does not match its key: packing again", self.path)
                return False
            mapping = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        mapping.madvise(mmap.MADV_HUGEPAGE)
        try:
            mapping.madvise(MADV_POPULATE_READ)  # every page mapped now, not in the first steps
        except OSError:
            pass
        self._mapping = mapping
        with warnings.catch_warnings():  # read-only memory: nothing writes a packed weight
            warnings.simplefilter("ignore", UserWarning)
            buffer = torch.frombuffer(mapping, dtype=torch.uint8)
        self._views = {(s.name, s.format): _view(buffer, o, s) for s, o in zip(self.slots, offsets)}
        try:
            os.utime(self.path)  # its last use, which `kiln cache prune` ages by
        except OSError:  # a read-only cache still serves its files
            pass
        if not _on_huge_pages(buffer):
            logger.info("%s is not on 2 MB pages here: its packed weights copied into memory for them", self.path)
            self._views = {k: _copy_for_huge_pages(v) for k, v in self._views.items()}
            self._mapping = None
            return True
        self._mapped(size)
        return True

    def _mapped(self, size: int) -> None:
        global _mapped
        self.mapped_bytes = size
        _mapped += size

    def _create(self) -> None:
        header, offsets, size = self._layout()
        folder = self.path.parent
        folder.mkdir(parents=True, exist_ok=True)
        _remove_stale(folder)
        self._tmp = folder / f"{self.key}.{os.getpid()}.tmp"
        self._fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        os.posix_fallocate(self._fd, 0, size)  # a full disk fails here, not as a SIGBUS while packing
        self._mapping = mmap.mmap(self._fd, size)
        self._mapping.madvise(mmap.MADV_HUGEPAGE)
        buffer = torch.frombuffer(self._mapping, dtype=torch.uint8)
        views = {(s.name, s.format): _view(buffer, o, s) for s, o in zip(self.slots, offsets)}
        if not _on_huge_pages(buffer, touch=True):
            logger.info("%s gets no 2 MB pages on this file system: packing in memory instead", folder)
            del buffer, views
            self._abandon()
            return
        self._mapping[:len(header)] = header
        self._views = views
        self._mapped(size)

    def _abandon(self) -> None:
        self._views, self.mapped_bytes, self._mapping = {}, 0, None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tmp is not None:
            self._tmp.unlink(missing_ok=True)
            self._tmp = None


def _finish(publisher: threading.Thread, path: Path) -> None:
    if publisher.is_alive():
        logger.info("waiting for the packed weights to reach %s", path)
        publisher.join()


def entries(folder: Path) -> list[tuple[Path, float, int]]:
    """(file, last use, bytes) of each published file under `folder`, and each unfinished one of a
    process no longer running: what `kiln cache prune` may remove. A mapped file stays readable to
    the processes that map it after it is removed."""
    out = []
    for path in folder.iterdir() if folder.is_dir() else ():
        if path.suffix == SUFFIX or (path.suffix == ".tmp" and not _writer_alive(path)):
            st = path.stat()
            out.append((path, st.st_mtime, st.st_size))
    return out


def _view(buffer: torch.Tensor, offset: int, s: Slot) -> torch.Tensor:
    return buffer[offset:offset + s.nbytes].view(getattr(torch, s.dtype)).view(s.shape)


def _copy_for_huge_pages(view: torch.Tensor) -> torch.Tensor:
    out = huge_pages.empty(view.shape, view.dtype)
    out.copy_(view)
    huge_pages.collapse_later(out)
    return out


def _on_huge_pages(buffer: torch.Tensor, touch: bool = False) -> bool:
    """Whether the mapping under `buffer` gets 2 MB pages, judged by its second one (the first holds
    the header), written first where `touch`; True for a mapping too short to have two."""
    start = -buffer.data_ptr() % huge_pages.HUGE_PAGE + huge_pages.HUGE_PAGE
    if start + huge_pages.HUGE_PAGE > buffer.numel():
        return True
    probe = buffer[start:start + huge_pages.HUGE_PAGE]
    if touch:
        probe.zero_()
    else:
        probe.sum()
    return _pmd_mapped_bytes(buffer.data_ptr()) > 0


def _pmd_mapped_bytes(address: int) -> int:
    """FilePmdMapped of the mapping that holds `address` (/proc/self/smaps); 0 where unknown."""
    try:
        smaps = Path("/proc/self/smaps").read_text()
    except OSError:
        return 0
    for match in re.finditer(r"^([0-9a-f]+)-([0-9a-f]+) ", smaps, re.MULTILINE):
        if int(match[1], 16) <= address < int(match[2], 16):
            found = re.search(r"^FilePmdMapped:\s+(\d+) kB", smaps[match.end():], re.MULTILINE)
            return int(found[1]) * 1024 if found else 0
    return 0


def _remove_stale(folder: Path) -> None:
    """Remove the unfinished files of processes no longer running."""
    for tmp in folder.glob("*.tmp"):
        if not _writer_alive(tmp):
            tmp.unlink(missing_ok=True)


def _writer_alive(tmp: Path) -> bool:
    """Whether the process that writes unfinished file `tmp` (KEY.PID.tmp) still runs."""
    pid = tmp.name.split(".")[-2] if tmp.name.count(".") >= 2 else ""
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc
