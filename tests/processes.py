"""Running kiln the way users do, in fresh processes: with no C++ compiler reachable, as a server,
and as the ranks of a tensor-parallel group."""

import contextlib
import json
import os
import socket
import sys
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def bare_env(tmp_path: Path, **extra) -> dict:
    """An environment with no C++ compiler anywhere: PATH is an empty directory (python is run by
    absolute path), CXX/CC are /bin/false, and Inductor's cache and temp dirs are empty."""
    bin_dir = tmp_path / "bin"
    for d in ("bin", "inductor", "tmp"):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
    return {
        "HOME": str(tmp_path),
        "PATH": str(bin_dir),
        "CXX": "/bin/false",
        "CC": "/bin/false",
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
        "TMPDIR": str(tmp_path / "tmp"),
        "PYTHONPATH": str(REPO),
        **extra,
    }


def run_ranks(script: str, args: list[str], world_size: int = 2, timeout: float = 600) -> list:
    """Run `script` (Python source) as ranks 0..world_size-1 with torchrun's variables set, and return
    what each printed as JSON on its last stdout line, by rank."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONPATH": str(REPO)}
        procs.append(subprocess.Popen([sys.executable, "-c", script, *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            proc.kill()
    return results


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(cmd: list[str], port: int, log: Path, env: dict | None = None, timeout: float = 120,
            scheme: str = "http", verify=True) -> Iterator[str]:
    """Start `cmd` (a `kiln serve ... --port port`), wait until /health answers (over `scheme`,
    checking the certificate with `verify`), yield its base URL; stop it on the way out. Its output
    goes to `log`."""
    with server_process(cmd, port, log, env, timeout, scheme, verify) as (_, url):
        yield url


@contextlib.contextmanager
def server_process(cmd: list[str], port: int, log: Path, env: dict | None = None, timeout: float = 120,
                   scheme: str = "http", verify=True) -> Iterator[tuple[subprocess.Popen, str]]:
    """`serving`, yielding the process too (its pid, its exit)."""
    import httpx

    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"{scheme}://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.time() < deadline, f"server not ready in {timeout}s:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{url}/health", verify=verify).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield proc, url
    finally:
        proc.terminate()  # a drain: what a test left in flight gets up to --shutdown-timeout
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def processes_with(*args: str) -> list[int]:
    """Live processes whose command line holds `args` in a row (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        words = [w.decode(errors="replace") for w in cmdline]
        if any(words[i:i + len(args)] == list(args) for i in range(len(words))):
            found.append(int(entry.name))
    return found


def children(pid: int) -> list[int]:
    """Live (not zombie) child processes of `pid` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and alive(int(entry.name)):
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs: it exists and is not a zombie (a container's PID 1 may never reap one)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
