"""Process-wide counters of compiler work, which tests and `kiln compile` read."""

from collections import Counter

counters: Counter[str] = Counter()
"""Keys: graphs_traced, pieces, pieces_compiled (unique), pieces_reused, blobs_saved, blobs_loaded."""
