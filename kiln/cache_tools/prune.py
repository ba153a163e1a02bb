"""`kiln cache prune`: drop artifacts unused for a while, or the least recently used ones until the
cache fits a size. A key being compiled or loaded by a running process is never touched."""

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from kiln.cache_tools.entries import Entry, list_entries
from kiln.compiler import artifact, usage

logger = logging.getLogger(__name__)


@dataclass
class PruneReport:
    removed: list[Entry] = field(default_factory=list)
    busy: list[tuple[Entry, str]] = field(default_factory=list)
    """Entries prune would have removed but could not: (entry, why)."""
    kept: list[Entry] = field(default_factory=list)

    @property
    def freed_bytes(self) -> int:
        return sum(e.bytes for e in self.removed)


def prune(cache_dir: Path, older_than: float | None = None, max_size: int | None = None,
          dry_run: bool = False, now: float | None = None) -> PruneReport:
    """Remove artifacts whose last use (or creation) is more than `older_than` seconds ago, then the
    least recently used ones while the cache holds more than `max_size` bytes. `dry_run` only
    reports what would go (and cannot know which keys would turn out busy)."""
    now = time.time() if now is None else now
    entries = sorted(list_entries(cache_dir), key=lambda e: e.last_activity)  # least recently used first
    total = sum(e.bytes for e in entries)
    report = PruneReport()
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
