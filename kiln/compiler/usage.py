"""Who is using a cached artifact, and when it was last used: what `kiln cache prune` must respect.

Next to `<cache>/<key>/` live two small files:
  `.<key>.lock`  held (exclusively, through `filelock`) while a process compiles the key;
  `.<key>.use`   held with a *shared* flock by every process that has the artifact loaded, for as
                 long as it lives; its mtime is the artifact's last use.
A pruner deletes a key only while it holds both exclusively, so it never removes an artifact that is
being written or served. Shared locks need `fcntl` (POSIX); elsewhere leases are skipped.
"""

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

logger = logging.getLogger(__name__)


class Busy(Exception):
    """The key is being compiled or served right now."""


def compile_lock(path: Path, timeout: float = -1) -> FileLock:
    """The lock a compile of the artifact at `path` holds (`timeout=0`: fail at once if held)."""
    return FileLock(str(path.parent / f".{path.name}.lock"), timeout=timeout)


def use_file(path: Path) -> Path:
    return path.parent / f".{path.name}.use"


def last_used(path: Path) -> float | None:
    """When a process last loaded the artifact at `path` (seconds since the epoch); None: never."""
    try:
        return use_file(path).stat().st_mtime
    except OSError:
        return None


def record_use(path: Path) -> None:
    """Mark the artifact at `path` used now, without holding it."""
    try:
        use_file(path).touch()
    except OSError as e:
        logger.debug("cannot record use of %s: %s", path, e)


class Lease:
    """A shared hold on an artifact, kept by whatever keeps the loaded program; released on close,
    when it is garbage-collected, or when the process ends."""

    def __init__(self, fd: int):
        self._file = os.fdopen(fd, "rb")

    def close(self) -> None:
        self._file.close()


def _locked(path: Path, operation: int) -> int:
    """Open the use file and lock it; retry if a pruner replaced it meanwhile (a lock on an unlinked
    file would hide this process from the next pruner)."""
    while True:
        fd = os.open(use_file(path), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, operation)
            if os.fstat(fd).st_ino == os.stat(use_file(path)).st_ino:
                return fd
        except FileNotFoundError:
            pass
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)


def acquire(path: Path) -> Lease | None:
    """Mark the artifact at `path` in use by this process and record the use. None where the cache
    directory is read-only or has no flock (such a cache is not pruned by this process's rules)."""
    if fcntl is None:
        return None
    try:
        fd = _locked(path, fcntl.LOCK_SH)
        os.utime(fd)
    except OSError as e:
        logger.debug("no use lease on %s: %s", path, e)
        return None
    return Lease(fd)


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold the artifact at `path` against compiles and loads; raise Busy at once if either holds it.
    If the artifact is gone on the way out, so is its use file."""
    lock = compile_lock(path, timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise Busy(f"{path.name} is being compiled") from None
    try:
        if fcntl is None:
            yield
            return
        try:
            fd = _locked(path, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Busy(f"{path.name} is loaded by a running process") from None
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                if not path.exists():  # the artifact is gone: so is its record of use
                    os.unlink(use_file(path))
            os.close(fd)
    finally:
        lock.release()
