"""The decode attention kernel (`kiln.kernels.decode_attention`) as a library of its own. Attention
runs between the compiled pieces, from Python (the graph is split there), and a serve start has no
compiler: so a CPU artifact ships the kernel built by AOTInductor from a graph of the one op, every
dimension dynamic. The runtime calls it as `library(query, kv_cache, block_tables, seq_lens, params)`.
"""

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from kiln.compiler import panel_lowering
from kiln.compiler.aoti import CompiledLibrary
from kiln.compiler.piece_cache import PieceCache
from kiln.compiler.workers import CompileJob, compile_cached
from kiln.kernels.decode_attention import LIBRARY

EXAMPLES = {  # traced shapes: sizes all different (and above 1), so none is taken for another
    "query": ((3, 6, 16), torch.float32, (0, 1, 2)),
    "kv_cache": ((2, 7, 4, 2, 16), torch.float32, (1, 2, 3, 4)),
    "block_tables": ((3, 5), torch.int32, (0, 1)),
    "seq_lens": ((3,), torch.int32, (0,)),
    "params": ((2,), torch.float32, ()),
}
"""Argument -> (example shape, dtype, its dynamic dimensions)."""


def wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether an artifact for a model on `device` computing in `dtype` ships the library: the kernel
    is fp32 C++ for CPUs, and it needs its lowering (without it AOTInductor would call the op's Python
    reference from the library)."""
    return device.type == "cpu" and dtype == torch.float32 and panel_lowering.register()


def job() -> CompileJob:
    """The compile of the op for any batch, cache and model shape."""
    graph = fx.Graph()
    args = [graph.placeholder(name) for name in EXAMPLES]
    graph.output(graph.call_function(torch.ops.kiln.decode_attention.default, tuple(args)))
    mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=False))
    inputs = []
    for shape, dtype, dynamic in EXAMPLES.values():
        context = StatelessSymbolicContext(
            dynamic_sizes=[DimDynamic.DYNAMIC if d in dynamic else DimDynamic.STATIC for d in range(len(shape))],
            constraint_sizes=[None] * len(shape))
        inputs.append(mode.from_tensor(torch.empty(shape, dtype=dtype), symbolic_context=context))
    return CompileJob(fx.GraphModule(torch.nn.Module(), graph), inputs, mode)


def build(cache: PieceCache | None = None) -> CompiledLibrary:
    """The library, from the piece cache where another compile built it, else compiled."""
    return compile_cached({LIBRARY: job()}, cache, lambda name: "the decode attention library")[LIBRARY]
