"""The LM head's panel GEMMs as libraries of their own. The head runs outside the compiled graph (the
runtime picks the rows it needs, and the greedy screen decides which logits to compute), and a serve
start has no compiler: so where the compile chooses one of kiln's panel GEMMs for the head, the
artifact ships that kernel built by AOTInductor from a graph of the one op, its row count dynamic.
The runtime calls a library as `library(x, packed_weight)` -> [rows, vocab] fp32, the op's numbers.
"""

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from kiln.compiler.aoti import CompiledLibrary
from kiln.compiler.piece_cache import PieceCache
from kiln.compiler.workers import CompileJob, compile_cached
from kiln.kernels import panel_linear  # noqa: F401  (registers the ops)

OPS: dict[str, tuple[torch._ops.OpOverload, torch.dtype]] = {
    "panels16": (torch.ops.kiln.panel_linear.default, torch.float32),
    "panels16_int8": (torch.ops.kiln.panel_int8_linear.default, torch.int8),
}
"""Weight format -> (the op a library of it calls, the dtype of its input rows)."""

EXAMPLE_ROWS = 16
"""The row count traced (any count runs: the dimension stays symbolic)."""


def _gemm(op) -> fx.GraphModule:
    graph = fx.Graph()
    x, weight = graph.placeholder("x"), graph.placeholder("weight")
    graph.output(graph.call_function(op, (x, weight)))
    return fx.GraphModule(torch.nn.Module(), graph)


def job(format: str, shape: tuple[int, int]) -> CompileJob:
    """The compile of `format`'s op on a weight of `shape` ([vocab, hidden], packed in place), for
    any number of rows."""
    op, dtype = OPS[format]
    mode = FakeTensorMode(shape_env=ShapeEnv())
    rows = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DYNAMIC, DimDynamic.STATIC], constraint_sizes=[None] * 2)
    x = mode.from_tensor(torch.empty(EXAMPLE_ROWS, shape[1], dtype=dtype), symbolic_context=rows)
    weight = mode.from_tensor(torch.empty(shape, dtype=dtype))
    return CompileJob(_gemm(op), [x, weight], mode)


def build(formats: list[str], shape: tuple[int, int], cache: PieceCache | None = None) -> dict[str, CompiledLibrary]:
    """Each of `formats`' libraries for a head of `shape`, from the piece cache where another compile
    built it, else compiled side by side."""
    return compile_cached({format: job(format, shape) for format in formats}, cache,
                          lambda format: f"the LM head's {format} library")
