"""Session-wide fixtures: tiny demo models are written once per test run and shared.

Writing them trains each for half a minute (side by side, `tests.demo_models`); `KILN_TEST_DEMO_CACHE=DIR`
copies them from DIR instead (written there on first use), for quick runs of a few tests while developing.
Under pytest-xdist (`-n 2`, the README's command) the workers of one run share the trained demos and the
piece cache, so each is trained or compiled once per run, whichever worker needs it first, and each worker runs
on its own share of the CPUs (`pytest_configure`)."""

import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from kiln.models.demo import DEMO_ARCHS, MOE_DEMO_ARCHS, write_demo_model
from tests.demo_models import write_demo_models


SLOWEST_FIRST = ("test_quality.py", "test_quantization.py", "test_artifact.py", "test_server.py", "test_workers.py",
                 "test_compile.py", "test_moe.py", "test_tensor_parallel.py")
"""Modules that take minutes (real-model perplexity, several compiles each), run first: xdist hands whole modules
to its workers in collection order, and one of these collected last would leave the other worker idle meanwhile."""


def pytest_configure(config) -> None:
    """Under xdist, each worker (and all it starts) runs on its own share of the CPUs. Unpinned, each worker's
    torch ran on every core (kiln's default, `kiln.threads`) beside the other worker's threads and compilers:
    OpenMP's barriers then wait on descheduled threads, and the real-model gates ran 3-4x slower than alone."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if not worker or not count or not hasattr(os, "sched_setaffinity"):
        return
    cpus, index, count = sorted(ALL_CPUS), int(worker.removeprefix("gw")), int(count)
    share = len(cpus) // count
    if share and index < count:
        os.sched_setaffinity(0, cpus[index * share:(index + 1) * share])


ALL_CPUS = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
"""The CPUs the run was given, before a worker is pinned to its share."""


@contextmanager
def on_all_cpus():
    """Work the other worker waits for (training the demos) spreads over every CPU, children included."""
    if not ALL_CPUS:
        yield
        return
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, ALL_CPUS)
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def run_shared(tmp_path_factory, name: str) -> Path:
    """A directory every xdist worker of this test run shares (this run's own one without xdist)."""
    base = tmp_path_factory.getbasetemp()
    path = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / name
    path.mkdir(exist_ok=True)
    return path


@pytest.fixture(scope="session")
def demo_dirs(tmp_path_factory) -> dict:
    """One tiny model per supported architecture (GQA, odd heads, tied/untied, llama3 rope)."""
    root = tmp_path_factory.mktemp("demo")
    cache = Path(os.environ.get("KILN_TEST_DEMO_CACHE") or run_shared(tmp_path_factory, "demo-cache"))
    cache.mkdir(parents=True, exist_ok=True)
    with FileLock(str(cache / ".lock")):
        missing = {arch: cache / f".{arch}" for arch in DEMO_ARCHS if not (cache / arch).is_dir()}
        if missing:
            with on_all_cpus():
                trained = write_demo_models(missing)
            for arch, written in trained.items():
                written.rename(cache / arch)
    return {arch: Path(shutil.copytree(cache / arch, root / arch)) for arch in DEMO_ARCHS}


@pytest.fixture(scope="session")
def moe_dirs(tmp_path_factory) -> dict:
    """One tiny mixture-of-experts model per MoE architecture: two layers, random weights (untrained: a
    MoE demo trains slowly, and the tests compare numbers, not text)."""
    root = tmp_path_factory.mktemp("moe")
    return {arch: write_demo_model(root / arch, arch=arch, num_layers=2, train_steps=0) for arch in MOE_DEMO_ARCHS}


@pytest.fixture(scope="session")
def hf_models(demo_dirs) -> dict:
    from transformers import AutoModelForCausalLM

    return {
        arch: AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for arch, d in demo_dirs.items()
    }


@pytest.fixture(scope="session", autouse=True)
def shared_piece_cache(tmp_path_factory):
    """One piece cache for every artifact cache of the run, subprocesses included: a piece compiled
    for one test's artifact is reused by the next (AOTInductor compiles are not in Inductor's cache)."""
    with pytest.MonkeyPatch.context() as mp:
        root = run_shared(tmp_path_factory, "pieces")
        mp.setenv("KILN_PIECE_CACHE", str(root))
        yield root


@pytest.fixture(scope="session")
def kiln_cache(tmp_path_factory):
    """One artifact cache for the test run: each tiny model is compiled once and shared."""
    return tmp_path_factory.mktemp("kiln_cache")


@pytest.fixture(scope="session")
def llama_artifact(demo_dirs, kiln_cache):
    """The demo llama's artifact (compiled on first use)."""
    from kiln import LLM

    return LLM(demo_dirs["llama"], compile=True, cache_dir=kiln_cache).artifact_path


@pytest.fixture(scope="session")
def packed_artifact(demo_dirs, tmp_path_factory):
    """The demo llama compiled w7a8 (per-token int8 activations) with every projection on fbgemm's packed
    int8 GEMM, and its LM head
    packed for oneDNN (the choice's timings forced): its pieces call a kiln op through AOTInductor's
    proxy executor, so its blobs have call tables (the KV-cache write and the oneDNN projections,
    the other ops a CPU piece called, are now Inductor's own code or C shim calls)."""
    from kiln import LLM
    from kiln.kernels import packed_linear
    from kiln.passes import gemm_choice

    if not packed_linear.fbgemm_available():
        pytest.skip("this torch has no fbgemm quantized linear")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gemm_choice, "_streamed_time",
                   lambda fn, args: 0.5 if fn.kernel in ("fbgemm_w7a8", "onednn") else 2.0)
        mp.setattr(gemm_choice, "MIN_TIMED_ELEMENTS", 0)  # the demo's projections are time-worthy here
        return LLM(demo_dirs["llama"], compile=True, quantization="w7a8",
                   cache_dir=tmp_path_factory.mktemp("packed")).artifact_path
