"""`kiln cache export` and `kiln cache import`: one artifact as a .tar.gz, to compile in CI and serve
elsewhere. Both ends verify every file; an import lands in the cache in one rename or not at all.

An artifact is code: serving it executes its `programs/*.py` and loads its shared libraries. Import
only tarballs you trust; `export --sha256` writes a detached digest and `import --sha256` checks it,
so a tarball that crossed machines is the one that was exported."""

import os
import re
import shutil
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

from kiln.cache_tools.entries import KEY, Entry, read_entry
from kiln.cache_tools.verify import verify_entry
from kiln.compiler import artifact, usage
from kiln.compiler.artifact import file_sha256
from kiln.errors import KilnError


def write_digest(tarball: Path) -> Path:
    """`<tarball>.sha256` in `sha256sum`'s format (`sha256sum -c` checks it too)."""
    out = Path(f"{tarball}.sha256")
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(f"{file_sha256(tarball)}  {Path(tarball).name}\n")
    os.replace(tmp, out)
    return out


def expected_digest(given: str) -> str:
    """A sha256 given as 64 hex digits or as a file whose first word is them (a `.sha256` file)."""
    text = given.strip()
    if not re.fullmatch(r"[0-9a-fA-F]{64}", text):
        try:
            text = Path(given).read_text().split()[0]
        except (OSError, IndexError):
            raise KilnError(f"--sha256 {given}: give the tarball's sha256 (64 hex digits) or its .sha256 file") from None
        if not re.fullmatch(r"[0-9a-fA-F]{64}", text):
            raise KilnError(f"--sha256 {given}: the file does not start with a sha256 (64 hex digits)")
    return text.lower()


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
    """The one artifact directory the tarball holds; anything else in it (a path leading out of it, a
    link, a device) is refused before anything is unpacked."""
    for m in tar.getmembers():
        if m.issym() or m.islnk():
            raise KilnError(f"{tarball} holds a link, {m.name} -> {m.linkname}: refusing it (an artifact has only "
                            "files and directories)")
        if PurePosixPath(m.name).is_absolute() or ".." in PurePosixPath(m.name).parts:
            raise KilnError(f"{tarball} holds {m.name}, a path outside its artifact directory: refusing it")
    tops = {Path(m.name).parts[0] for m in tar.getmembers() if m.name not in ("", ".")}
    if len(tops) != 1 or not KEY.fullmatch(next(iter(tops))):
        raise KilnError(f"{tarball} is not a kiln artifact export (expected one <key>/ directory, found "
                        f"{', '.join(sorted(tops)) or 'nothing'})")
    for m in tar.getmembers():
        if not (m.isfile() or m.isdir()):
            raise KilnError(f"{tarball} holds {m.name}, which is neither a file nor a directory: refusing it")
    return next(iter(tops))


def import_tarball(cache_dir: Path, tarball: Path, sha256: str | None = None) -> tuple[Entry, bool]:
    """Unpack an exported artifact into `cache_dir` after verifying it (and, given `sha256`, that the
    tarball is the one exported); returns the entry and whether it was new (an intact copy already
    there is kept)."""
    tarball, cache_dir = Path(tarball), Path(cache_dir)
    if not tarball.is_file():
        raise KilnError(f"{tarball} does not exist")
    if sha256 is not None:
        want, got = expected_digest(sha256), file_sha256(tarball)
        if got != want:
            raise KilnError(f"{tarball} has sha256 {got}, not the {want} given: it is not the tarball that was "
                            "exported (or it was damaged on the way); nothing was imported")
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
