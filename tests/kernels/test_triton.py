"""kiln's Triton kernels match the native ops. Triton chooses its CPU interpreter when it is first
imported, and this test process imported it long ago (through Inductor), so the cases run in a
fresh pytest with TRITON_INTERPRET=1 (on a CUDA machine: on the GPU, no interpreter)."""

import os
import subprocess
import sys

import pytest
import torch

from tests.processes import REPO

CASES = REPO / "tests" / "kernels" / "triton_cases.py"


def test_triton_kernels_match_the_native_ops():
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(CASES)], env=env,
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout
