"""What every kiln benchmark shares: the machine it ran on, decode-step timing, the JSON it prints."""

import json
import statistics
import time
from pathlib import Path

import torch

from kiln.bench.decode import decode_step_seconds  # noqa: F401  (re-exported: the benchmarks' decode timing)


def machine() -> dict:
    return {"threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def median_seconds(fn, repeats: int = 200, sync=None) -> float:
    """Median wall time of `fn()` after a warm-up; `sync` (torch.cuda.synchronize on a GPU) runs
    around each call so the time covers the work, not just its launch."""
    sync = sync or (lambda: None)
    for _ in range(10):
        fn()
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def emit(results: dict, out: Path | None) -> None:
    """Print the results as JSON, and write them to `out` too when given."""
    text = json.dumps(results, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
