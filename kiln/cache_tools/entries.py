"""The artifacts in a cache directory, as the cache commands list and select them."""

import os
import re
from dataclasses import dataclass
from pathlib import Path

from kiln.compiler import artifact, usage
from kiln.errors import KilnError

KEY = artifact.KEY


@dataclass
class Entry:
    """One cached artifact. `manifest` is None when it cannot be read (`error` says why)."""

    key: str
    path: Path
    manifest: dict | None
    error: str | None
    bytes: int

    @property
    def created(self) -> float:
        """When the artifact was written (its directory's mtime: set by the final rename)."""
        return self.path.stat().st_mtime

    @property
    def last_used(self) -> float | None:
        return usage.last_used(self.path)

    @property
    def last_activity(self) -> float:
        """The later of creation and last use: what prune ages by."""
        return max(self.created, self.last_used or 0.0)

    def factor(self, *path: str, default: object = None) -> object:
        value: object = (self.manifest or {}).get("factors", {})
        for part in path:
            if not isinstance(value, dict) or part not in value:
                return default
            value = value[part]
        return value


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def read_entry(path: Path) -> Entry:
    try:
        manifest, error = artifact.read_manifest(path, check_key=False), None
    except artifact.ArtifactError as e:
        manifest, error = None, str(e)
    return Entry(path.name, path, manifest, error, dir_bytes(path))


def _names(cache_dir: Path) -> list[str]:
    """The names in a cache directory; none where there is nothing yet. A path that cannot be one (a file,
    a link loop, no permission) raises its OSError, for the CLI to name it."""
    try:
        return os.listdir(cache_dir)
    except FileNotFoundError:
        return []


def list_entries(cache_dir: Path) -> list[Entry]:
    """Every artifact directory under `cache_dir`, newest first (in-progress and stale dirs are hidden)."""
    cache_dir = Path(cache_dir)
    paths = [cache_dir / name for name in _names(cache_dir)]
    paths = [p for p in paths if p.is_dir() and KEY.fullmatch(p.name)]
    return sorted((read_entry(p) for p in paths), key=lambda e: e.created, reverse=True)


def find_entry(cache_dir: Path, key: str) -> Entry:
    """The artifact named by `key`: a full key, a unique prefix of one (like git), or a directory."""
    if os.sep in key or key in (".", "..") or (Path(key) / artifact.MANIFEST).is_file():
        path = Path(key)
        if not (path / artifact.MANIFEST).is_file():
            raise KilnError(f"{path} is not an artifact directory (no {artifact.MANIFEST})")
        return read_entry(path)
    names = _names(Path(cache_dir)) if re.fullmatch(r"[0-9a-f]{1,32}", key) else []
    matches = [Path(cache_dir) / n for n in names if n.startswith(key) and KEY.fullmatch(n)]
    matches = [p for p in matches if p.is_dir()]
    if not matches:
        raise KilnError(f"no artifact {key!r} in {cache_dir}: `kiln cache ls` lists them")
    if len(matches) > 1:
        names = ", ".join(sorted(p.name for p in matches))
        raise KilnError(f"{key!r} names several artifacts in {cache_dir} ({names}): give more of the key")
    return read_entry(matches[0])
