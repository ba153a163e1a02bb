"""Which kernel runs a kiln norm or activation op on CUDA: kiln's Triton kernel, or the code Inductor
generates for the op's native form. Decided by measurement, once per compile, and recorded.

For each op the graph calls (per distinct argument signature) both candidates run on random inputs
at the token counts that bound the size range being compiled, the Triton kernel (`kiln_triton::*`)
and the native form compiled by Inductor alone; the kernel is chosen only if it is faster at each
of them. Chosen calls are retargeted to the `kiln_triton` op, which the lowering pass leaves whole
and AOTInductor compiles into the library; the others are lowered as on CPU. On CPU there are no
such kernels and nothing is measured.
"""

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import fx

from kiln.kernels.activation import silu_and_mul_native
from kiln.kernels.fused_quant import (fused_add_rms_norm_quant_native, rms_norm_quant_native,
                                     silu_and_mul_quant_native)
from kiln.kernels.norm import fused_add_rms_norm_native, rms_norm_native

logger = logging.getLogger(__name__)

MAX_MEASURED_TOKENS = 4096
"""The largest token count measured: a range's upper bound is clipped to it."""


NATIVE: dict[str, Callable] = {
    "rms_norm": rms_norm_native,
    "fused_add_rms_norm": fused_add_rms_norm_native,
    "rms_norm_quant": rms_norm_quant_native,
    "fused_add_rms_norm_quant": fused_add_rms_norm_quant_native,
    "silu_and_mul": silu_and_mul_native,
    "silu_and_mul_quant": silu_and_mul_quant_native,
}
"""Each op with a Triton twin -> its native form: what Inductor compiles when the op is lowered."""


@dataclass(frozen=True)
class KernelChoice:
    """One op's decision: the token counts measured and the median milliseconds of each candidate."""

    op: str
    kernel: str  # "triton" or "inductor"
    tokens: tuple[int, ...]
    triton_ms: tuple[float, ...]
    inductor_ms: tuple[float, ...]
    calls: int  # graph nodes it applies to

    def as_dict(self) -> dict:
        return asdict(self)


Timer = Callable[[Callable, Sequence], float]


def time_call(fn: Callable, args: Sequence, repeats: int = 20) -> float:
    """Median milliseconds of `fn(*args)`: on CUDA its GPU time, from a CUDA graph of back-to-back
    calls (what a compiled piece pays, launched from C++ or replayed: Python's launch overhead, tens
    of microseconds, would decide every small-batch choice); elsewhere wall time after a warm-up."""
    for _ in range(3):
        fn(*args)
    on_cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
    if on_cuda:
        try:
            return _cuda_graph_ms(fn, args, repeats)
        except RuntimeError as e:  # a candidate that cannot be captured is timed as launched
            logger.info("timing without a CUDA graph (%s)", e)
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn(*args)
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _cuda_graph_ms(fn: Callable, args: Sequence, calls: int, replays: int = 5) -> float:
    """Median milliseconds of one call, replayed from a CUDA graph of `calls` calls."""
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def _concrete(value, tokens: int, generator: torch.Generator):
    """A real input like the traced `value`, its symbolic (token) dimensions set to `tokens`."""
    if not isinstance(value, torch.Tensor):
        return value
    shape = [tokens if isinstance(s, torch.SymInt) else int(s) for s in value.shape]
    if value.dtype.is_floating_point and value.dtype.itemsize > 1:  # drawn on the CPU: `generator` is a CPU one
        return torch.randn(shape, dtype=value.dtype, generator=generator).to(value.device)
    return torch.zeros(shape, dtype=value.dtype, device=value.device)


def _signature(node: fx.Node) -> tuple:
    def one(a):
        if isinstance(a, fx.Node):
            v = a.meta["val"]
            return ("tensor", v.dtype, v.device.type, tuple(str(s) for s in v.shape))
        return ("value", repr(a))

    return (node.target, tuple(one(a) for a in node.args), tuple((k, one(v)) for k, v in node.kwargs.items()))


def _kiln_op(node: fx.Node) -> str | None:
    target = node.target
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "kiln":
        return target.overloadpacket.__name__
    return None


def triton_twins() -> dict[str, object] | None:
    """kiln op name -> its `kiln_triton` op, or None where Triton cannot run (no CUDA, no triton)."""
    import importlib.util

    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return None
    from kiln.kernels.triton.ops import OPS

    return {name: getattr(torch.ops.kiln_triton, name).default for name in OPS}


def choose_kernels(graph: fx.Graph, tokens: Sequence[int], twins: dict[str, object] | None = None,
                   timer: Timer = time_call, device_types: tuple[str, ...] = ("cuda",)) -> list[KernelChoice]:
    """Measure and retarget, in place, the calls whose Triton kernel beats Inductor at every count
    in `tokens`. `twins` defaults to `triton_twins()`; tests pass their own twins, timer and devices."""
    twins = triton_twins() if twins is None else twins
    if not twins:
        return []
    groups: dict[tuple, list[fx.Node]] = {}
    for node in graph.nodes:
        name = _kiln_op(node) if node.op == "call_function" else None
        val = next((a.meta["val"] for a in node.args if isinstance(a, fx.Node)), None)
        if name in twins and name in NATIVE and val is not None and val.device.type in device_types:
            groups.setdefault(_signature(node), []).append(node)
    choices = []
    generator = torch.Generator()
    for nodes in groups.values():
        name = _kiln_op(nodes[0])
        compiled = torch.compile(NATIVE[name], dynamic=False, fullgraph=True)
        triton_ms, inductor_ms = [], []
        for n in tokens:
            generator.manual_seed(n)
            args = [_concrete(a.meta["val"] if isinstance(a, fx.Node) else a, n, generator) for a in nodes[0].args]
            kwargs = {k: _concrete(v.meta["val"] if isinstance(v, fx.Node) else v, n, generator)
                      for k, v in nodes[0].kwargs.items()}
            triton_ms.append(timer(lambda *a: twins[name](*a, **kwargs), args))
            inductor_ms.append(timer(lambda *a: compiled(*a, **kwargs), args))
        faster = all(t < i for t, i in zip(triton_ms, inductor_ms))
        if faster:
            for node in nodes:
                node.target = twins[name]
        choice = KernelChoice(name, "triton" if faster else "inductor", tuple(tokens), tuple(triton_ms),
                              tuple(inductor_ms), len(nodes))
        logger.info("kernel for %s (%d calls): %s (triton %s ms, inductor %s ms at %s tokens)", name, len(nodes),
                    choice.kernel, _ms(triton_ms), _ms(inductor_ms), list(tokens))
        choices.append(choice)
    return choices


def _ms(values: Sequence[float]) -> str:
    return "/".join(f"{v:.4f}" for v in values)


def measured_tokens(size_range: tuple[int, int]) -> tuple[int, ...]:
    """The token counts a choice is measured at: the range's bounds, the upper clipped."""
    lo, hi = size_range
    return tuple(sorted({lo, min(hi, MAX_MEASURED_TOKENS)}))
