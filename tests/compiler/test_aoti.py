"""The AOTInductor call table's dtype arguments, renumbered for torch 2.11's proxy executor."""

import json
import warnings

import pytest
import torch

from kiln.compiler.aoti import C10_SCALAR_TYPES, c10_dtype_numbers
from kiln.errors import KilnError


def _number(x: torch.Tensor) -> int:
    return x.dtype  # TorchScript's dtype is c10's ScalarType number


def test_c10_numbers_are_the_ones_torch_uses():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript's deprecation
        number = torch.jit.script(_number)
    assert {d: number(torch.empty(0, dtype=d)) for d in C10_SCALAR_TYPES} == C10_SCALAR_TYPES


def _table(*numbers: int) -> bytes:
    inputs = [{"name": "a", "arg": {"as_tensor": {"name": "buf1"}}, "kind": 1}]
    inputs += [{"name": f"d{i}", "arg": {"as_scalar_type": n}, "kind": 1} for i, n in enumerate(numbers)]
    return json.dumps({"nodes": [{"name": "buf3", "node": {"target": "kiln::scaled_mm", "inputs": inputs}}]}).encode()


def test_dtype_arguments_are_renumbered_and_nothing_else():
    # torch.export numbers float32 7, bfloat16 13, int8 2, float8_e4m3fn 29; c10: 6, 15, 1, 24
    table = json.loads(c10_dtype_numbers(_table(7, 13, 2, 29)))
    inputs = table["nodes"][0]["node"]["inputs"]
    assert [i["arg"] for i in inputs[1:]] == [{"as_scalar_type": n} for n in (6, 15, 1, 24)]
    assert inputs[0] == json.loads(_table())["nodes"][0]["node"]["inputs"][0]


def test_a_dtype_without_a_c10_number_is_refused():
    with pytest.raises(KilnError, match="torch 2.12 or newer"):
        c10_dtype_numbers(_table(9))  # complex32


def test_cuda_libraries_run_without_the_containers_event_bookkeeping(monkeypatch, tmp_path):
    """The container's default run queries a CUDA event first, which a CUDA graph capture forbids: a
    CUDA library must be loaded single-threaded (torch's runner has no CUDA here, so a stand-in
    records how it is built)."""
    from kiln.compiler.aoti import LoadedLibrary

    built = []

    class Runner:
        def __init__(self, *args):
            built.append(args)

        def run(self, tensors):
            return tensors

    monkeypatch.setattr(torch._C._aoti, "AOTIModelContainerRunnerCuda", Runner, raising=False)
    library = LoadedLibrary(tmp_path / "piece.so", (1,), device="cuda:0")
    assert built == [(str(tmp_path / "piece.so"), 1, "cuda:0", "", True)]
    assert library(3, "x") == ["x"]


def test_a_library_with_the_cxx_runtime_linked_in_is_refused(monkeypatch, tmp_path, llama_artifact):
    """A compiler that links libstdc++ statically (seen as `$CXX` on a GPU machine) makes libraries
    torch's runner crashes on: the compile refuses them, naming the compiler and the fix. A library
    built as usual (the session's demo artifact's) names libstdc++ as a shared library."""
    import shutil

    from torch._inductor import config
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from kiln.compiler.aoti import compile_library, needed_libraries

    if shutil.which("g++") is None:
        pytest.skip("no g++ to build with")
    compiler = tmp_path / "static-g++"
    compiler.write_text(f'#!/bin/sh\ncase "$*" in *-shared*) set -- "$@" -static-libstdc++;; esac\n'
                        f'exec {shutil.which("g++")} "$@"\n')
    compiler.chmod(0o755)

    def piece(x, w):
        return (torch.relu(x @ w) + 1,)

    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    with fake_mode:
        examples = [torch.empty(4, 8), torch.empty(8, 8)]
    blobs = list((llama_artifact / "blobs").glob("*.so"))
    assert blobs
    for blob in blobs:
        assert any(name.startswith("libstdc++.so") for name in needed_libraries(blob.read_bytes())), blob
    monkeypatch.setattr(config.cpp, "cxx", (str(compiler),))
    with pytest.raises(KilnError, match=r"static-g\+\+ linked the C\+\+ runtime .* statically.*CXX=/usr/bin/g\+\+"):
        compile_library(make_fx(piece)(torch.randn(4, 8), torch.randn(8, 8)), examples, fake_mode)
