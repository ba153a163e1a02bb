"""What every kiln benchmark shares: the machine it ran on, decode-step timing, the JSON it prints."""

import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from kiln.bench.decode import decode_step_seconds  # noqa: F401  (re-exported: the benchmarks' decode timing)


def machine() -> dict:
    return {"cpu": _cpu_name(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def _cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), so each figure says which machine gave it."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return "unknown"
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")


def hf_cache_argument(model) -> str:
    """The keyword transformers' forward takes its KV cache by: `cache` from 5.24 on (where
    `past_key_values` is deprecated), `past_key_values` before."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: Path, log: Path | None, *options: str) -> tuple[subprocess.Popen, str, float]:
    """Start `kiln serve MODEL_DIR OPTIONS...` in a fresh process, as a user would; return (process,
    base URL, seconds from start to the first 200 on /health). Output goes to `log` (None: dropped)."""
    import httpx

    port = free_port()
    cmd = [sys.executable, "-m", "kiln", "-v", "serve", str(model_dir), "--port", str(port), *options]
    start = time.perf_counter()
    out = open(log, "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    while proc.poll() is None:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base, time.perf_counter() - start
        except httpx.TransportError:
            time.sleep(0.05)
    raise RuntimeError(f"kiln serve exited with {proc.returncode}" + (f": see {log}" if log else ""))


def process_memory(pid: int, field: str = "VmHWM") -> int:
    """Bytes of a process's VmRSS or VmHWM (peak) from /proc (Linux). Not ru_maxrss: that one keeps
    the parent's peak across fork and exec."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0

