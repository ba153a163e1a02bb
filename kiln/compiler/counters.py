"""Process-wide counters of compiler work, which tests and `kiln compile` read."""

from collections import Counter

counters: Counter[str] = Counter()
"""Keys: graphs_traced, pieces, pieces_compiled (Inductor compiles: one per unique graph and size),
pieces_reused (a piece served by an earlier compile of this artifact), pieces_cached (one served by
the piece cache: compiled for another artifact), blobs_saved, blobs_loaded, triton_kernels_compiled
(Triton kernels compiled rather than found in Triton's cache, counted once a CUDA artifact loads)."""
