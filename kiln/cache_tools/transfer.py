"""`kiln cache export` and `kiln cache import`: one artifact as a .tar.gz, to compile in CI and serve
elsewhere. Both ends verify every file; an import lands in the cache in one rename or not at all.

An artifact is code: serving it executes its `programs/*.py` and loads its shared libraries. Import
only tarballs you trust; `export --sha256` writes a detached digest and `import --sha256` checks it,
so a tarball that crossed machines is the one that was exported. An import unpacks only what the
artifact's manifest lists, at the sizes it pins, so a hostile or damaged tarball cannot fill the disk."""

import os
import re
import shutil
import tarfile
import tempfile
import zlib
from pathlib import Path, PurePosixPath

from kiln.cache_tools.entries import KEY, Entry, read_entry
from kiln.units import format_size
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


MANIFEST_LIMIT = 64 << 20
"""The largest manifest.json an import reads into memory (a real one is well under a megabyte)."""
UNLISTED_LIMIT = 10_000
"""The most members an import holds, unchecked, before it reaches the manifest that lists them."""
SIZE_FACTOR = 4
"""`import`'s default --max-size: this many times the bytes the tarball's manifest declares."""


def export_entry(entry: Entry, out: Path) -> Path:
    """Write `entry` to the tarball `out` (written aside, then renamed into place): its manifest first,
    so an import checks every later member as it reads it, then only the files the manifest pins (a
    stray file in the directory would make the tarball unimportable)."""
    verdict = verify_entry(entry)
    if not verdict.ok:
        raise KilnError(f"will not export a damaged artifact: {verdict.problems[0]}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}-", dir=out.parent)
    os.close(fd)
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            tar.add(entry.path, arcname=entry.key, recursive=False)
            tar.add(entry.path / artifact.MANIFEST, arcname=f"{entry.key}/{artifact.MANIFEST}")
            added = {Path(".")}
            for file in sorted(f.relative_to(entry.path) for f, _, _ in artifact.pinned_files(entry.path,
                                                                                              entry.manifest)):
                for folder in reversed(file.parents):
                    if folder not in added:
                        tar.add(entry.path / folder, arcname=f"{entry.key}/{folder.as_posix()}", recursive=False)
                        added.add(folder)
                tar.add(entry.path / file, arcname=f"{entry.key}/{file.as_posix()}")
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out


def _relative(m: tarfile.TarInfo, tarball: Path) -> PurePosixPath:
    """The member's path without `./` and empty parts (`tar -C DIR .` writes `./<key>/...`); a link, a
    device, or a path leading out of the tarball is refused before anything is unpacked."""
    if m.issym() or m.islnk():
        raise KilnError(f"{tarball} holds a link, {m.name} -> {m.linkname}: refusing it (an artifact has only "
                        "files and directories)")
    name = PurePosixPath(m.name)
    if name.is_absolute() or ".." in name.parts:
        raise KilnError(f"{tarball} holds {m.name}, a path outside its artifact directory: refusing it")
    if not (m.isfile() or m.isdir()):
        raise KilnError(f"{tarball} holds {m.name}, which is neither a file nor a directory: refusing it")
    if not name.parts and not m.isdir():
        raise KilnError(f"{tarball} holds a file named {m.name!r}, which names no file: refusing it")
    return name


class _Listing:
    """What the tarball's manifest says its artifact holds: every file with the bytes it pins (the
    manifest's own included) and the directories on their paths; nothing else is unpacked."""

    def __init__(self, tarball: Path, key: str, member: tarfile.TarInfo, data: bytes):
        where = f"{tarball}: {key}/{artifact.MANIFEST}"
        try:
            manifest = artifact.parse_manifest(data, Path(key) / artifact.MANIFEST)
        except artifact.ArtifactError as e:
            raise KilnError(f"{tarball} holds a bad manifest: {e}") from None
        if (problem := artifact.key_problem(manifest, key)) is not None:
            raise KilnError(f"{tarball} holds artifact {key}, but {problem}: refusing it")
        self.tarball = tarball
        self.files = {PurePosixPath(key, artifact.MANIFEST): member.size}
        try:
            for path, entry, what in artifact.pinned_files(Path(key), manifest):
                rel, size = PurePosixPath(path.as_posix()), entry["bytes"]
                if rel.is_absolute() or ".." in rel.parts or rel.parts[:1] != (key,) or len(rel.parts) < 2:
                    raise KilnError(f"{where} pins {what} {path}, a path outside its artifact directory: refusing it")
                if type(size) is not int or size < 0:
                    raise KilnError(f"{where} pins {what} {path} at {size!r} bytes, not a size: refusing it")
                self.files[rel] = size
        except (KeyError, TypeError, AttributeError, IndexError, ValueError) as e:
            raise KilnError(f"{where} lacks or mangles {e}: refusing it") from None
        self.dirs = {folder for rel in self.files for folder in rel.parents if folder.parts}
        self.declared = sum(self.files.values())

    def check(self, m: tarfile.TarInfo, rel: PurePosixPath) -> None:
        """Refuse a member the manifest does not list, or a file whose header size is not the pinned one
        (read from the header: nothing of it is unpacked)."""
        if rel not in (self.dirs if m.isdir() else self.files):
            raise KilnError(f"{self.tarball} holds {m.name}, which its manifest does not list: refusing it")
        if m.isfile() and m.size != self.files[rel]:
            raise KilnError(f"{self.tarball} holds {m.name} of {m.size} bytes, but its manifest pins "
                            f"{self.files[rel]}: refusing it (the tarball is damaged or was edited)")


def _too_big(tarball: Path, total: int, m: tarfile.TarInfo, cap: int, default: bool) -> KilnError:
    why = f" ({SIZE_FACTOR}x the {format_size(cap // SIZE_FACTOR)} its manifest declares)" if default else ""
    return KilnError(f"{tarball} holds {format_size(total)} of files or more (at {m.name}); --max-size is "
                     f"{format_size(cap)}{why}: raise it if you trust this tarball")


def _members(tar: tarfile.TarFile, tarball: Path, max_size: int | None) -> tuple[str, list[tarfile.TarInfo]]:
    """The tarball's one artifact directory (its key) and the members to unpack, named without `./`.

    Every header is checked before anything is written: one `<key>/` directory, no links or paths
    leading out, no member twice, only what the manifest lists (which bounds the number of entries),
    each file at the size the manifest pins, and the total within `max_size` (default SIZE_FACTOR
    times what the manifest declares). Members before the manifest wait for it to be read."""
    key, listing, cap, total = None, None, max_size, 0
    seen: dict[PurePosixPath, tarfile.TarInfo] = {}
    for m in tar:
        rel = _relative(m, tarball)
        if not rel.parts:  # "./", the tarball's root
            continue
        if key is None:
            key = rel.parts[0]
        if rel.parts[0] != key or not KEY.fullmatch(key):
            found = ", ".join(sorted({key, rel.parts[0]}))
            raise KilnError(f"{tarball} is not a kiln artifact export (expected one <key>/ directory, found {found})")
        if rel in seen:
            raise KilnError(f"{tarball} holds {m.name} twice: refusing it")
        if listing is None and len(seen) >= UNLISTED_LIMIT:
            raise KilnError(f"{tarball} holds more than {UNLISTED_LIMIT} entries before its manifest: refusing it "
                            "(`kiln cache export` writes the manifest first)")
        seen[rel] = m
        total += m.size if m.isfile() else 0
        if rel == PurePosixPath(key, artifact.MANIFEST) and m.isfile():
            if m.size > MANIFEST_LIMIT:
                raise KilnError(f"{tarball} holds {m.name} of {format_size(m.size)}; a manifest is at most "
                                f"{format_size(MANIFEST_LIMIT)}: refusing it")
            listing = _Listing(tarball, key, m, tar.extractfile(m).read())
            cap = max_size if max_size is not None else SIZE_FACTOR * listing.declared
            for earlier, member in seen.items():
                listing.check(member, earlier)
        elif listing is not None:
            listing.check(m, rel)
        if cap is not None and total > cap:
            raise _too_big(tarball, total, m, cap, max_size is None)
    if key is None:
        raise KilnError(f"{tarball} is not a kiln artifact export (expected one <key>/ directory, found nothing)")
    if listing is None:
        raise KilnError(f"{tarball} holds no {key}/{artifact.MANIFEST}: it is not a kiln artifact export")
    return key, [m.replace(name=str(rel), deep=False) for rel, m in seen.items()]


def _free_bytes(folder: Path) -> int:
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def import_tarball(cache_dir: Path, tarball: Path, sha256: str | None = None,
                   max_size: int | None = None) -> tuple[Entry, bool]:
    """Unpack an exported artifact into `cache_dir` after verifying it (and, given `sha256`, that the
    tarball is the one exported); returns the entry and whether it was new (an intact copy already
    there is kept). Only the files its manifest lists are unpacked, and only after every header
    passed `_members`' checks (`max_size`: the most bytes of files to unpack)."""
    tarball, cache_dir = Path(tarball), Path(cache_dir)
    if not tarball.is_file():
        raise KilnError(f"{tarball} does not exist")
    if sha256 is not None:
        want, got = expected_digest(sha256), file_sha256(tarball)
        if got != want:
            raise KilnError(f"{tarball} has sha256 {got}, not the {want} given: it is not the tarball that was "
                            "exported (or it was damaged on the way); nothing was imported")
    staging = None
    try:
        try:
            with tarfile.open(tarball, "r:*") as tar:
                key, members = _members(tar, tarball, max_size)
                size = sum(m.size for m in members if m.isfile())
                if size > (free := _free_bytes(cache_dir)):
                    raise KilnError(f"{tarball} holds {format_size(size)} of files; {cache_dir} has "
                                    f"{format_size(free)} free: free some space (`kiln cache prune`) first")
                cache_dir.mkdir(parents=True, exist_ok=True)
                staging = Path(tempfile.mkdtemp(prefix=".import-", dir=cache_dir))
                tar.extractall(staging, members=members, filter="data")
        except (tarfile.TarError, EOFError, OSError, zlib.error) as e:
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
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
