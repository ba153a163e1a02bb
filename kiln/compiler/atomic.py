"""Files that appear whole: written beside their place, then moved in with one `os.replace`, so a
reader (or a crash) sees the old file or the new one, never part of one."""

import os
import tempfile
from pathlib import Path


_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once, at import: reading the umask means setting it, which races with other threads


def shareable(path: Path) -> Path:
    """`path`, made by `tempfile` (files 0600, folders 0700), given the mode `open` or `mkdir` would
    have given it: a cache several users share stays readable to them."""
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~_UMASK)
    return Path(path)


def write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(shareable(tmp), path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
