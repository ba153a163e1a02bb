"""kiln's C++ kernels that run between or after the compiled pieces, each as a library of its own:
the decode attention (`kiln.kernels.decode_attention`), which runs between the pieces from Python
(the graph is split there), and the LM head's greedy screen (`kiln.kernels.greedy_screen`), which
runs after them. A serve start has no compiler, so a CPU artifact ships each kernel built by
AOTInductor from a graph of its one op, every dimension dynamic; the runtime calls a library with the
op's tensor arguments (`LIBRARY_ARGS` of the kernel's module).
"""

from dataclasses import dataclass

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from kiln.compiler import panel_lowering
from kiln.compiler.aoti import CompiledLibrary
from kiln.compiler.piece_cache import PieceCache
from kiln.compiler.workers import CompileJob, compile_cached
from kiln.kernels import decode_attention, greedy_screen


@dataclass(frozen=True)
class KernelLibrary:
    """One kernel's library: its name among an artifact's `libraries`, and the op's arguments traced,
    name -> (example shape, dtype, its dynamic dimensions)."""

    name: str
    examples: dict[str, tuple[tuple[int, ...], torch.dtype, tuple[int, ...]]]

    def job(self) -> CompileJob:
        """The compile of the op for any shapes of its arguments."""
        graph = fx.Graph()
        args = [graph.placeholder(name) for name in self.examples]
        graph.output(graph.call_function(getattr(torch.ops.kiln, self.name).default, tuple(args)))
        mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=False))
        inputs = []
        for shape, dtype, dynamic in self.examples.values():
            context = StatelessSymbolicContext(
                dynamic_sizes=[DimDynamic.DYNAMIC if d in dynamic else DimDynamic.STATIC for d in range(len(shape))],
                constraint_sizes=[None] * len(shape))
            inputs.append(mode.from_tensor(torch.empty(shape, dtype=dtype), symbolic_context=context))
        return CompileJob(fx.GraphModule(torch.nn.Module(), graph), inputs, mode)


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
    return device.type == "cpu" and dtype == torch.float32 and panel_lowering.register()


def screen_wanted(lm_head: dict | None) -> bool:
    """Whether an artifact ships the greedy screen's library: where the compile chose kiln's int8 panel
    GEMM for the LM head's screen (the kernel runs on it), and the lowering registers."""
    return lm_head is not None and lm_head.get("screen") == "panels16_int8" and panel_lowering.register()


def build(libraries: list[KernelLibrary], cache: PieceCache | None = None) -> dict[str, CompiledLibrary]:
    """Each of `libraries` by name, from the piece cache where another compile built it, else compiled
    side by side."""
    return compile_cached({library.name: library.job() for library in libraries}, cache,
                          lambda name: f"the {name.replace('_', ' ')} library")
