"""CPU threads: the physical cores by default, said at start; --threads overrides."""

import os

import pytest
import torch

from kiln import KilnError
from kiln.threads import describe, physical_cores, use_threads
from tests.test_cli import kiln


@pytest.fixture
def restore_threads():
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)


def test_physical_cores_are_among_the_cpus_this_process_may_use():
    assert 1 <= physical_cores() <= len(os.sched_getaffinity(0))


def test_default_is_the_physical_cores_and_a_count_overrides(restore_threads):
    assert use_threads() == physical_cores() == torch.get_num_threads()
    assert use_threads(3) == 3 == torch.get_num_threads()
    with pytest.raises(KilnError, match="threads must be at least 1, got 0"):
        use_threads(0)


def test_generate_says_its_threads_at_start(demo_dirs):
    proc = kiln("generate", demo_dirs["llama"], "--prompt", "The kiln was", "--max-tokens", "2")
    assert f"kiln: {describe(physical_cores(), asked=False)}" in proc.stderr
    proc = kiln("generate", demo_dirs["llama"], "--prompt", "The kiln was", "--max-tokens", "2", "--threads", "1")
    assert "kiln: 1 CPU threads (as asked)" in proc.stderr
    proc = kiln("generate", demo_dirs["llama"], "--prompt", "x", "--threads", "0", check=False)
    assert proc.returncode == 2 and "--threads: must be at least 1, got 0" in proc.stderr
