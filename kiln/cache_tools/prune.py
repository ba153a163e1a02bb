"""`kiln cache prune`: drop artifacts unused for a while, or the least recently used ones until the
cache fits a size. A key being compiled or loaded by a running process is never touched. Compiled
pieces kept for reuse in `<cache>/pieces` age out the same way and, under a size limit, go first:
they only speed up compiles. So do the packed weights kept in `<cache>/packed` for faster loads
(`kiln.weights.pack_cache`; a process that maps one keeps reading it once removed). (A piece or pack
cache moved elsewhere by `$KILN_PIECE_CACHE` or `$KILN_PACK_CACHE` is not this cache's to prune.)"""

import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from kiln.cache_tools.entries import Entry, list_entries
from kiln.compiler import artifact, usage
from kiln.compiler.piece_cache import FOLDER, PieceCache
from kiln.weights import pack_cache

logger = logging.getLogger(__name__)


@dataclass
class PruneReport:
    removed: list[Entry] = field(default_factory=list)
    busy: list[tuple[Entry, str]] = field(default_factory=list)
    """Entries prune would have removed but could not: (entry, why)."""
    kept: list[Entry] = field(default_factory=list)
    pieces_removed: int = 0
    pieces_freed_bytes: int = 0
    packed_removed: int = 0
    """Files of packed weights removed (`kiln.weights.pack_cache`); their bytes count in `pieces_freed_bytes`."""

    @property
    def freed_bytes(self) -> int:
        return sum(e.bytes for e in self.removed) + self.pieces_freed_bytes


def prune(cache_dir: Path, older_than: float | None = None, max_size: int | None = None,
          dry_run: bool = False, now: float | None = None) -> PruneReport:
    """Remove artifacts whose last use (or creation) is more than `older_than` seconds ago, then the
    least recently used ones while the cache holds more than `max_size` bytes. `dry_run` only
    reports what would go (and cannot know which keys would turn out busy)."""
    now = time.time() if now is None else now
    entries = sorted(list_entries(cache_dir), key=lambda e: e.last_activity)  # least recently used first
    packed = Path(cache_dir) / pack_cache.FOLDER
    piece_entries = sorted(PieceCache(Path(cache_dir) / FOLDER).entries() + pack_cache.entries(packed),
                           key=lambda e: e[1])
    total = sum(e.bytes for e in entries) + sum(size for _, _, size in piece_entries)
    report = PruneReport()
    for path, used, size in piece_entries:
        if (older_than is not None and now - used > older_than) or (max_size is not None and total > max_size):
            if not dry_run:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            if path.parent == packed:
                report.packed_removed += 1
            else:
                report.pieces_removed += 1
            report.pieces_freed_bytes += size
            total -= size
    for entry in entries:
        too_old = older_than is not None and now - entry.last_activity > older_than
        too_big = max_size is not None and total > max_size
        if not (too_old or too_big):
            report.kept.append(entry)
            continue
        if dry_run:
            report.removed.append(entry)
            total -= entry.bytes
            continue
        try:
            with usage.exclusive(entry.path):
                artifact.remove(entry.path)
        except usage.Busy as e:
            report.busy.append((entry, str(e)))
            report.kept.append(entry)
            continue
        logger.info("pruned %s (%d bytes)", entry.key, entry.bytes)
        report.removed.append(entry)
        total -= entry.bytes
    return report
