"""Tensor-parallel groups from torchrun's environment and `kiln::all_reduce`, in two gloo processes."""

import pytest
import torch

import kiln.kernels  # noqa: F401  (registers torch.ops.kiln)
from kiln.config import ParallelConfig
from kiln.errors import KilnError
from kiln.runtime.parallel import init_from_env
from tests.processes import run_ranks

RANK = """
import json, torch
import kiln.kernels
from kiln.runtime.parallel import init_from_env
tp = init_from_env()
x = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (tp.rank + 1)
graphs = []
def capture(gm, example_inputs):
    graphs.append(gm.code)
    return gm.forward
compiled = torch.compile(lambda x: torch.ops.kiln.all_reduce(x * 2, tp.group_name) + 1, backend=capture,
                         fullgraph=True)
print(json.dumps({"rank": tp.rank, "world_size": tp.world_size, "group": tp.group_name,
                  "eager": torch.ops.kiln.all_reduce(x, tp.group_name).tolist(),
                  "compiled": compiled(x).tolist(), "graph": graphs[0]}))
"""


def test_two_gloo_ranks_sum_with_kiln_all_reduce():
    results = run_ranks(RANK, [], timeout=240)
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    for rank, got in enumerate(results):
        assert (got["rank"], got["world_size"], got["group"]) == (rank, 2, "")  # "": the default group
        assert got["eager"] == (x * 1 + x * 2).tolist()
        assert got["compiled"] == ((x * 2 + x * 4) + 1).tolist()
        assert f"torch.ops.kiln.all_reduce(mul, {got['group']!r})" in got["graph"]  # one op, kept whole


def test_one_process_is_a_world_of_one(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert init_from_env() == ParallelConfig()
    x = torch.randn(3)
    torch.testing.assert_close(torch.ops.kiln.all_reduce(x, ""), x)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(KilnError, match="MASTER_PORT is not: start kiln with `torchrun"):
        init_from_env()
    with pytest.raises(KilnError, match="rank 2 is outside world size 2"):
        ParallelConfig(rank=2, world_size=2)
