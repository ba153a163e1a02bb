"""Running kiln the way users do, in fresh processes: with no C++ compiler reachable, and as a server."""

import contextlib
import socket
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(cmd: list[str], port: int, log: Path, env: dict | None = None, timeout: float = 120) -> Iterator[str]:
    """Start `cmd` (a `kiln serve ... --port port`), wait until /health answers, yield its base URL;
    stop it on the way out. Its output goes to `log`."""
    import httpx

    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout
        while True:
            assert proc.poll() is None, f"server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            assert time.time() < deadline, f"server not ready in {timeout}s:\n{log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
