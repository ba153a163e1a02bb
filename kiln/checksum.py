"""The checksum kiln keeps of bytes it writes to a cache and reads back: XXH3-128 (python-xxhash).

Why XXH3: it runs at memory speed on one thread, so checking every byte costs next to nothing at a
start where sha256 would take seconds (docs/integrity.md has the measurements); and it releases the
GIL, so reads on several threads also hash in parallel. It detects
damage (a flipped bit, a zeroed page, a splice of another file), not tampering: an artifact's
manifest, which says what to run, stays under sha256.
"""

import xxhash

ALGORITHM = "xxh3_128"


def digest(data: object) -> bytes:
    """The 16-byte XXH3-128 of a bytes-like object (a memoryview of a tensor's bytes works)."""
    return xxhash.xxh3_128_digest(data)


def hasher() -> "xxhash.xxh3_128":
    """A streaming XXH3-128: `update` it chunk by chunk, then `digest()` equals `digest` of the whole."""
    return xxhash.xxh3_128()
