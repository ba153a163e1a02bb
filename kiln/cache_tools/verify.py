"""`kiln cache verify`: re-hash every file of an artifact and say whether it would load here."""

from dataclasses import dataclass, field

from kiln.cache_tools.entries import Entry
from kiln.compiler import artifact


@dataclass
class Verdict:
    key: str
    problems: list[str] = field(default_factory=list)
    """Corruption: a file missing, truncated or altered, or a manifest that does not match its key."""
    incompatible: str | None = None
    """Intact, but built for another torch, Python or machine: it would not load here."""
    files: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems


def verify_entry(entry: Entry) -> Verdict:
    """Check every file the manifest pins (size and sha256), and that the key is the hash of the
    manifest's factors (so no one renamed or edited the artifact)."""
    if entry.manifest is None:
        return Verdict(entry.key, [entry.error or "unreadable manifest"])
    manifest = entry.manifest
    verdict = Verdict(entry.key, artifact.file_problems(entry.path, manifest), artifact.compatibility_problem(manifest))
    try:
        verdict.files = len(artifact.pinned_files(entry.path, manifest))
    except (KeyError, TypeError, AttributeError):
        pass  # file_problems named what the manifest lacks
    if (problem := artifact.key_problem(manifest, entry.key)) is not None:
        verdict.problems.append(f"artifact {entry.path}: {problem}")
    return verdict
