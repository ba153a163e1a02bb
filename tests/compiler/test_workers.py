"""Compiling pieces side by side in forked workers: how many, and that what they build runs."""

import pytest
import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from kiln.compiler.aoti import LoadedLibrary, tensor_args
from kiln.compiler.compile import normalize
from kiln.compiler.workers import ENV, CompileJob, compile_jobs, worker_count
from kiln.errors import KilnError


def _job(fn) -> CompileJob:
    mode = FakeTensorMode(shape_env=ShapeEnv())
    rows = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC], constraint_sizes=[None] * 2)
    inputs = [mode.from_tensor(torch.empty(5, 8), symbolic_context=rows), mode.from_tensor(torch.empty(8, 4))]
    graph = normalize(fx.symbolic_trace(fn))
    for node, value in zip(graph.graph.find_nodes(op="placeholder"), inputs):
        node.meta["val"] = value
    return CompileJob(graph, inputs, mode)


def test_worker_count(monkeypatch):
    cpu = [_job(lambda x, w: x @ w)] * 3
    monkeypatch.setenv(ENV, "2")
    assert worker_count(cpu) == 2 and worker_count(cpu[:1]) == 1
    monkeypatch.setenv(ENV, "1")
    assert worker_count(cpu) == 1
    monkeypatch.setenv(ENV, "8")
    assert worker_count(cpu) == 3  # never more than there are jobs
    meta = CompileJob(cpu[0].graph, [torch.empty(2, 8, device="meta")], cpu[0].fake_mode)
    assert worker_count([meta, meta]) == 1  # only CPU compiles fork
    for bad in ("0", "two"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(KilnError, match=ENV):
            worker_count(cpu)


def test_forked_workers_build_libraries_that_run(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV, "2")
    fns = [lambda x, w: torch.relu(x @ w), lambda x, w: torch.sigmoid(x @ w) * 2]
    jobs = [_job(fn) for fn in fns]
    results = list(compile_jobs(jobs))
    assert sorted(i for i, _, _ in results) == [0, 1]
    x, w = torch.randn(7, 8), torch.randn(8, 4)
    for i, compiled, seconds in results:
        assert seconds > 0
        path = tmp_path / f"{i}.so"
        path.write_bytes(compiled.library)
        [out] = LoadedLibrary(path, tensor_args(jobs[i].inputs))(x, w)
        torch.testing.assert_close(out, fns[i](x, w))


PROBE_IMPORTS = """
import importlib.abc, sys, threading
seen = []
class Recorder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        seen.append((threading.current_thread().name, name))
sys.meta_path.insert(0, Recorder())
from kiln.compiler import workers
workers.probe_cpu_in_background()
workers.cpu_probe_done()
print(sorted(name for thread, name in seen if thread == "kiln-isa-probe"))
"""


def test_isa_probe_thread_imports_nothing():
    # a module imported by the probe thread and the tracing thread at once can reach one of them half
    # initialized: in CI, one of four concurrent `kiln compile`s failed that way
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PROBE_IMPORTS], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout
