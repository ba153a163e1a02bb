"""`kiln cache export` and `kiln cache import`: one artifact as a .tar.gz, to compile in CI and serve
elsewhere. Both ends verify every file; an import lands in the cache in one rename or not at all."""

import os
import shutil
import tarfile
import tempfile
from pathlib import Path

from kiln.cache_tools.entries import KEY, Entry, read_entry
from kiln.cache_tools.verify import verify_entry
from kiln.compiler import artifact, usage
from kiln.errors import KilnError


def export_entry(entry: Entry, out: Path) -> Path:
    """Write `entry` to the tarball `out` (written aside, then renamed into place)."""
    verdict = verify_entry(entry)
    if not verdict.ok:
        raise KilnError(f"will not export a damaged artifact: {verdict.problems[0]}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}-", dir=out.parent)
    os.close(fd)
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(entry.path, arcname=entry.key)
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def _key_of(tar: tarfile.TarFile, tarball: Path) -> str:
    """The one artifact directory the tarball holds; anything else in it is refused."""
    tops = {Path(m.name).parts[0] for m in tar.getmembers() if m.name not in ("", ".")}
    if len(tops) != 1 or not KEY.fullmatch(next(iter(tops))):
        raise KilnError(f"{tarball} is not a kiln artifact export (expected one <key>/ directory, found "
                        f"{', '.join(sorted(tops)) or 'nothing'})")
    for m in tar.getmembers():
        if not (m.isfile() or m.isdir()):
            raise KilnError(f"{tarball} holds {m.name}, which is neither a file nor a directory: refusing it")
    return next(iter(tops))


def import_tarball(cache_dir: Path, tarball: Path) -> tuple[Entry, bool]:
    """Unpack an exported artifact into `cache_dir` after verifying it; returns the entry and whether
    it was new (an intact copy already there is kept)."""
    tarball, cache_dir = Path(tarball), Path(cache_dir)
    if not tarball.is_file():
        raise KilnError(f"{tarball} does not exist")
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".import-", dir=cache_dir))
    try:
        try:
            with tarfile.open(tarball, "r:*") as tar:
                key = _key_of(tar, tarball)
                tar.extractall(staging, filter="data")
        except (tarfile.TarError, EOFError, OSError) as e:
            raise KilnError(f"{tarball} is not a readable tarball ({e})") from None
        staged = read_entry(staging / key)
        verdict = verify_entry(staged)
        if not verdict.ok:
            raise KilnError(f"{tarball} holds a damaged artifact: {'; '.join(verdict.problems)}")
        if verdict.incompatible:
            raise KilnError(f"{tarball} would not load on this machine: {verdict.incompatible}")
        path = cache_dir / key
        with usage.compile_lock(path):
            if path.exists():
                if verify_entry(read_entry(path)).ok:
                    return read_entry(path), False
                artifact.remove(path)
            os.replace(staging / key, path)
        usage.record_use(path)  # an old build just imported is not prune's first pick
        return read_entry(path), True
    finally:
        shutil.rmtree(staging, ignore_errors=True)
