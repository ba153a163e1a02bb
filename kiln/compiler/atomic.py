"""Files that appear whole: written beside their place, then moved in with one `os.replace`, so a
reader (or a crash) sees the old file or the new one, never part of one."""

import os
import tempfile
from pathlib import Path


def write_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
