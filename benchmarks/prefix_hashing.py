"""The cost of prefix-cache block hashes: sha256 (kiln's, collision-resistant) against the 64-bit
Python `hash()` kiln used before, per block, for a 2048-token prompt's admission and for a decode step
in which 64 running sequences each fill a block (the most a step hashes). One process, one run.

    python benchmarks/prefix_hashing.py [--out results.json] [--block-size 16]
"""

import argparse
import random
import sys
from pathlib import Path

from harness import emit, machine, median_seconds

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kiln.runtime.kv_cache import block_hashes  # noqa: E402


def python_hashes(token_ids: list[int], block_size: int, start: int = 0, parent: int | None = None) -> list[int]:
    """The former scheme, as it was: a chain of Python tuple hashes."""
    hashes = []
    for i in range(start, len(token_ids) // block_size):
        parent = hash((parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        hashes.append(parent)
    return hashes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    bs, rnd = args.block_size, random.Random(0)
    prompt = [rnd.randrange(151936) for _ in range(2048)]
    seqs = [[rnd.randrange(151936) for _ in range(512)] for _ in range(64)]
    results = {"machine": machine(), "block_size": bs}
    for name, fn in (("python_hash", python_hashes), ("sha256", block_hashes)):
        parents = [fn(s[: 31 * bs], bs)[-1] for s in seqs]
        results[name] = {
            "prompt_2048_us": round(median_seconds(lambda: fn(prompt, bs), repeats=200) * 1e6, 1),
            "decode_step_64_blocks_us": round(median_seconds(
                lambda: [fn(s[: 32 * bs], bs, 31, p) for s, p in zip(seqs, parents)], repeats=200) * 1e6, 1),
        }
    results["sha256_vs_python_hash"] = {k: round(results["sha256"][k] / results["python_hash"][k], 2)
                                        for k in results["sha256"]}
    emit(results, args.out)


if __name__ == "__main__":
    main()
