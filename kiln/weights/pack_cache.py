"""Packed weights kept in a file beside the artifacts, so that a later load reads them back instead of
packing them again; every byte read back is checked first.

The first load packs into memory (`kiln.weights.formats.pack`), and a background thread writes the packed
weights to a new file, with an XXH3-128 checksum of each slot, makes it durable (fsync), read-only,
and publishes it by a rename (a process that exits sooner waits for it). A later load reads each slot
as its weight would be packed (on the packing threads) straight into memory of its own with
positioned reads, hashing each chunk as it arrives: a file whose size or header disagrees is not
read, and a slot whose checksum disagrees is named in a warning and packed from its weight, then the
file is written anew. A damaged file costs a repack, never a wrong token.

Why a copy, not a map of the file: a mapping serves whatever the file holds now. Rewriting the file
in place changes a running server's weights under it, and truncating it kills every process that maps
it (SIGBUS), whatever the file's mode. Weights of one's own cost a read of the file (from the page
cache: memory speed) and 4 KB pages until `huge_pages` collapses them in idle time, and processes on
one machine no longer share them; the checksum of what is read is the checksum of what is served.

A file is keyed by its caller's identity of what it packs (`kiln.LLM`'s: the XXH3 of every
checkpoint byte loaded, the quantization, the tensor-parallel shard, torch's version and kiln's
source) and by the slots (names, formats, shapes). The files live in `<cache>/packed/`
(`$KILN_PACK_CACHE` moves them; `off` turns the cache off); `kiln cache prune` ages them out with the
artifacts.
"""

import atexit
import hashlib
import json
import logging
import math
import os
import stat
import struct
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kiln import checksum
from kiln.kernels import gemms
from kiln.weights import formats, huge_pages

logger = logging.getLogger(__name__)

VERSION = 2
"""The file layout's version (part of the key). 2: a checksum per slot after the slots."""
FOLDER = "packed"
"""Where the files live in a cache directory."""
ENV = "KILN_PACK_CACHE"
SUFFIX = ".bin"
MAGIC = b"KILNPACK"
ALIGN = 4096
"""Each slot's offset in the file: a page."""
DIGEST_BYTES = 16
"""One slot's XXH3-128, in the trailer."""
CHUNK = 8 << 20
"""Bytes read, then hashed while still in cache."""


def folder_for(cache_dir: Path) -> Path | None:
    """Where packed weights are kept for the artifacts in `cache_dir`, or where `$KILN_PACK_CACHE`
    says (None when it says `off`)."""
    where = os.environ.get(ENV, "")
    if where.lower() in ("off", "0", "none"):
        return None
    return Path(where).expanduser() if where else Path(cache_dir) / FOLDER


@dataclass(frozen=True)
class Slot:
    """One packed weight in a file: the weight's name, its format (`gemms.PLAIN_FORMATS`),
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
    if format not in gemms.PLAIN_FORMATS or weight.device.type != "cpu":
        return None
    return Slot(name, format, tuple(weight.shape), str(weight.dtype).removeprefix("torch."))


def cache_key(identity: dict, slots: list[Slot]) -> str:
    """The file name's key: `identity` (whatever tells what the packed bytes came from) and the
    slots, under this layout's version."""
    blob = json.dumps({"version": VERSION, "identity": identity, "slots": [asdict(s) for s in slots]}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class PackFile:
    """The packed weights of one load, kept in one file under `folder`: each slot read back from it as
    its weight is packed, where the file is there and the slot intact, else packed in memory; after a
    miss or any damage the whole file is written anew (`publish`). A weight with no slot is packed in
    memory and not kept."""

    def __init__(self, folder: Path, identity: dict, slots: list[Slot]):
        self.slots = list(dict.fromkeys(slots))
        self.key = cache_key(identity, self.slots)
        self.path = Path(folder) / f"{self.key}{SUFFIX}"
        self.hit = False
        """Whether every slot came from the file, intact (known once all are packed: `publish`)."""
        self.read_bytes = 0
        """Bytes of packed weights read back from the file."""
        self.damaged: list[str] = []
        """The slots whose bytes did not match their checksum."""
        self._packed: dict[tuple[str, str], torch.Tensor] = {}
        self._wanted = set(self.slots)
        self._where: dict[tuple[str, str], tuple[Slot, int, bytes]] = {}
        self._fd: int | None = None
        self._lock = threading.Lock()
        self._started = time.perf_counter()
        self._publisher: threading.Thread | None = None
        if self.slots:
            try:
                self._open()
            except OSError as e:
                logger.warning("packed weights in %s not read (%s): packing them again", self.path, e)
                self._close()

    def read(self, name: str, format: str) -> torch.Tensor | None:
        """Slot (`name`, `format`) read from the file into memory of this process's own and checked
        against its checksum; None where the file does not hold it intact (a warning names the file
        and the slot)."""
        where = self._where.get((name, format))
        if where is None or self._fd is None:
            return None
        s, offset, expected = where
        tensor = _read_slot(self._fd, s, offset, expected)
        with self._lock:
            if tensor is None:
                self.damaged.append(name)
                if len(self.damaged) == 1:
                    logger.warning("packed weights file %s is damaged (the checksum of %s does not match): packing "
                                   "again", self.path, name)
                return None
            self.read_bytes += s.nbytes
        huge_pages.collapse_later(tensor)
        return tensor

    def pack(self, name: str, format: str, weight: torch.Tensor) -> torch.Tensor:
        """`weight` packed in `format`: the file's copy where it holds one intact, else packed now (and
        kept for the file where it has a slot)."""
        out = self.read(name, format)
        if out is None:
            out = formats.pack(format, weight)
        if Slot(name, format, tuple(out.shape), _dtype(out)) in self._wanted:
            self._packed[name, format] = out
        return out

    def publish(self) -> None:
        """Once every slot is packed: where any slot was not read intact from the file, a background
        thread writes the file anew and renames it into place; exit waits for it."""
        self._close()
        tensors = [self._packed.get((s.name, s.format)) for s in self.slots]
        self._packed = {}  # the program holds them; the writer holds them until written
        if not tensors or any(t is None for t in tensors):
            return
        self.hit = self.read_bytes == sum(s.nbytes for s in self.slots)
        if self.hit:
            logger.info("read %d packed weights (%.2f GB) from %s, checksums verified, in %.2fs", len(self.slots),
                        self.read_bytes / 1e9, self.path, time.perf_counter() - self._started)
            try:
                os.utime(self.path)  # its last use, which `kiln cache prune` ages by
            except OSError:  # a read-only cache still serves its files
                pass
            return

        def write() -> None:
            try:
                self._write(tensors)
            except OSError as e:
                logger.warning("packed weights not kept in %s (%s): the next load packs them again", self.path.parent, e)

        self._publisher = threading.Thread(target=write, name="kiln-pack-cache", daemon=True)
        self._publisher.start()
        atexit.register(_finish, self._publisher, self.path)

    def wait(self) -> None:
        """Wait until a file being published is in place."""
        if self._publisher is not None:
            _finish(self._publisher, self.path)

    # ---- the file ----

    def _layout(self) -> tuple[bytes, list[int], int]:
        """(the header, each slot's offset, where the trailer of checksums starts)."""
        entries = [asdict(s) for s in self.slots]
        header = json.dumps({"version": VERSION, "key": self.key, "checksum": checksum.ALGORITHM,
                             "slots": entries}).encode()
        offset = _align(len(MAGIC) + 8 + len(header))
        offsets = []
        for s in self.slots:
            offsets.append(offset)
            offset = _align(offset + s.nbytes)
        return MAGIC + struct.pack("<Q", len(header)) + header, offsets, offset

    def _open(self) -> None:
        """Open the published file where its size and header are this key's, and read its checksums;
        the slots are read as they are packed (`read`), each into memory freed by the plain weights
        packed before it rather than into fresh memory, which a VM's host may have to fault in."""
        header, offsets, trailer = self._layout()
        size = trailer + DIGEST_BYTES * len(self.slots)
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return
        self._fd = fd
        found = os.fstat(fd).st_size
        if found != size or os.pread(fd, len(header), 0) != header:
            problem = f"is {found} bytes, not {size}" if found != size else "has another header"
            logger.warning("packed weights file %s %s (damaged, or not this key's): packing again", self.path, problem)
            self._close()
            return
        digests = os.pread(fd, DIGEST_BYTES * len(self.slots), trailer)
        self._where = {(s.name, s.format): (s, o, digests[i * DIGEST_BYTES:(i + 1) * DIGEST_BYTES])
                       for i, (s, o) in enumerate(zip(self.slots, offsets))}

    def _close(self) -> None:
        self._where = {}
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _write(self, tensors: list[torch.Tensor]) -> None:
        """Write the file aside, durable and read-only, then rename it into place."""
        started = time.perf_counter()
        header, offsets, trailer = self._layout()
        folder = self.path.parent
        folder.mkdir(parents=True, exist_ok=True)
        _remove_stale(folder)
        tmp = folder / f"{self.key}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            size = trailer + DIGEST_BYTES * len(tensors)
            os.posix_fallocate(fd, 0, size)  # a full disk fails here, before anything is written
            _write_all(fd, header, 0)
            digests = []
            for tensor, offset in zip(tensors, offsets):
                data = _bytes_of(tensor)
                digests.append(checksum.digest(data))
                _write_all(fd, data, offset)
            _write_all(fd, b"".join(digests), trailer)
            os.fchmod(fd, stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)  # published read-only
            os.fsync(fd)
            os.replace(tmp, self.path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        directory = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
        logger.info("wrote %.2f GB of packed weights to %s in %.2fs", size / 1e9, self.path,
                    time.perf_counter() - started)


def _read_slot(fd: int, s: Slot, offset: int, expected: bytes) -> torch.Tensor | None:
    """Slot `s` read from `fd` into a new tensor (on its way to huge pages), hashed chunk by chunk as it
    arrives; None where the bytes do not match their checksum."""
    tensor = huge_pages.empty(s.shape, getattr(torch, s.dtype))
    view = _bytes_of(tensor)
    h = checksum.hasher()
    done = 0
    while done < len(view):
        chunk = view[done:done + CHUNK]
        n = os.preadv(fd, [chunk], offset + done)
        if n == 0:
            return None  # cut short under us
        h.update(chunk[:n])
        done += n
    return tensor if h.digest() == expected else None


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view[:1 << 30], offset)
        view, offset = view[n:], offset + n


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy())


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _finish(publisher: threading.Thread, path: Path) -> None:
    if publisher.is_alive():
        logger.info("waiting for the packed weights to reach %s", path)
        publisher.join()


def entries(folder: Path) -> list[tuple[Path, float, int]]:
    """(file, last use, bytes) of each published file under `folder`, and each unfinished one of a
    process no longer running: what `kiln cache prune` may remove (a process that read one holds its
    own copy)."""
    out = []
    for path in folder.iterdir() if folder.is_dir() else ():
        if path.suffix == SUFFIX or (path.suffix == ".tmp" and not _writer_alive(path)):
            st = path.stat()
            out.append((path, st.st_mtime, st.st_size))
    return out


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
