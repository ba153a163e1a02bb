"""kiln's C++ kernels that run outside the compiled pieces, each shipped as a library of its own.

A serve start has no compiler, so an artifact ships each such kernel built by AOTInductor from a
graph of its one op:
- the LM head's panel GEMMs (`kiln.kernels.gemms`), when the compile chose one for the head: the
  head runs after the pieces (the runtime picks the rows it needs, and the greedy screen decides
  which logits to compute). The runtime calls it as `library(x, packed_weight)` -> [rows, vocab] fp32,
  or for the blocked int8 GEMM `library(x, x_scale, packed_weight)`; its row count is dynamic.
- the decode attention (`kiln.kernels.decode_attention`), which runs between the pieces from Python
  (the graph is split there), and the LM head's greedy screen (`kiln.kernels.greedy_screen`), which
  runs after them: every dimension dynamic, called with the op's tensor arguments (`LIBRARY_ARGS` of
  the kernel's module).
"""

from dataclasses import dataclass

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from kiln.compiler.aoti import CompiledLibrary
from kiln.compiler.piece_cache import PieceCache
from kiln.compiler.workers import CompileJob, compile_cached
from kiln.kernels import cpp_lowering, decode_attention, gemms, greedy_screen
from kiln.kernels.quant import ACT_BLOCK

HEAD_FORMATS = {c.id: c for c in (gemms.PANELS16, gemms.PANELS16_INT8, gemms.PANELS8_INT8_BLOCK)}
"""The head formats whose GEMM ships as a library (the others are torch's own oneDNN calls)."""
HEAD_EXAMPLE_ROWS = 16
"""The row count traced for a head library (any count runs: the dimension stays symbolic)."""


def _symbolic(mode: FakeTensorMode, shape: tuple[int, ...], dtype: torch.dtype, dynamic) -> torch.Tensor:
    context = StatelessSymbolicContext(
        dynamic_sizes=[DimDynamic.DYNAMIC if d in dynamic else DimDynamic.STATIC for d in range(len(shape))],
        constraint_sizes=[None] * len(shape))
    return mode.from_tensor(torch.empty(shape, dtype=dtype), symbolic_context=context)


def _one_op(op, names: list[str]) -> fx.GraphModule:
    graph = fx.Graph()
    graph.output(graph.call_function(op, tuple(graph.placeholder(name) for name in names)))
    return fx.GraphModule(torch.nn.Module(), graph)


def head_job(format: str, shape: tuple[int, int]) -> CompileJob:
    """The compile of `format`'s GEMM on a head weight of `shape` ([vocab, hidden], packed in place),
    for any number of rows."""
    candidate = HEAD_FORMATS[format]
    dtype = torch.float32 if "float" in candidate.kinds else torch.int8
    mode = FakeTensorMode(shape_env=ShapeEnv())
    x = _symbolic(mode, (HEAD_EXAMPLE_ROWS, shape[1]), dtype, (0,))
    weight = mode.from_tensor(torch.empty(shape, dtype=dtype))
    if candidate is gemms.PANELS8_INT8_BLOCK:  # the rows' block scales between them
        scales = _symbolic(mode, (HEAD_EXAMPLE_ROWS, shape[1] // ACT_BLOCK), torch.float32, (0,))
        return CompileJob(_one_op(candidate.op, ["x", "x_scale", "weight"]), [x, scales, weight], mode)
    return CompileJob(_one_op(candidate.op, ["x", "weight"]), [x, weight], mode)


def build_head(formats: list[str], shape: tuple[int, int], cache: PieceCache | None = None) -> dict[str, CompiledLibrary]:
    """Each of `formats`' head libraries for a head of `shape`, from the piece cache where another
    compile built it, else compiled side by side."""
    return compile_cached({format: head_job(format, shape) for format in formats}, cache,
                          lambda format: f"the LM head's {format} library")


@dataclass(frozen=True)
class KernelLibrary:
    """One kernel's library: its name among an artifact's `libraries`, and the op's arguments traced,
    name -> (example shape, dtype, its dynamic dimensions)."""

    name: str
    examples: dict[str, tuple[tuple[int, ...], torch.dtype, tuple[int, ...]]]

    def job(self) -> CompileJob:
        """The compile of the op for any shapes of its arguments."""
        mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=False))
        inputs = [_symbolic(mode, shape, dtype, dynamic) for shape, dtype, dynamic in self.examples.values()]
        return CompileJob(_one_op(getattr(torch.ops.kiln, self.name).default, list(self.examples)), inputs, mode)


# traced shapes, above 1: each dimension gets a symbol of its own (duck_shape=False), equal sizes too
DECODE_ATTENTION = KernelLibrary(decode_attention.LIBRARY, {
    "query": ((3, 6, 16), torch.float32, (0, 1, 2)),
    "kv_cache": ((2, 7, 4, 2, 16), torch.float32, (1, 2, 3, 4)),
    "block_tables": ((3, 5), torch.int32, (0, 1)),
    "seq_lens": ((3,), torch.int32, (0,)),
    "params": ((2,), torch.float32, ()),
})
GREEDY_SCREEN = KernelLibrary(greedy_screen.LIBRARY, {
    "hidden": ((3, 64), torch.float32, (0, 1)),
    "codes": ((48, 64), torch.int8, (0, 1)),
    "scales": ((48,), torch.float32, (0,)),
    "weight": ((48, 64), torch.float32, (0, 1)),
    "params": ((4,), torch.float64, ()),
})


def attention_wanted(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether an artifact for a model on `device` computing in `dtype` ships the decode attention's
    library: the kernel is fp32 C++ for CPUs, and it needs its lowering (without it AOTInductor would
    call the op's Python reference from the library)."""
    return device.type == "cpu" and dtype == torch.float32 and cpp_lowering.register()


def screen_wanted(lm_head: dict | None) -> bool:
    """Whether an artifact ships the greedy screen's library: where the compile chose kiln's int8 panel
    GEMM for the LM head's screen (the kernel runs on it), and the lowering registers."""
    return lm_head is not None and lm_head.get("screen") == gemms.PANELS16_INT8.id and cpp_lowering.register()


def build(libraries: list[KernelLibrary], cache: PieceCache | None = None) -> dict[str, CompiledLibrary]:
    """Each of `libraries` by name, from the piece cache where another compile built it, else compiled
    side by side."""
    return compile_cached({library.name: library.job() for library in libraries}, cache,
                          lambda name: f"the {name.replace('_', ' ')} library")
