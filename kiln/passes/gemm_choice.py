"""Which kernel runs each projection on CPU: torch's GEMM on the weight as loaded (what Inductor calls
for `mm`/`addmm`, and `kiln::scaled_mm`'s native form), or a oneDNN kernel on a weight the runtime
packs once at load (`kiln.kernels.packed_linear`). Decided by measurement per weight shape and kind,
and recorded with the format each weight input takes.

The token counts measured span the whole compile, not one size range: a weight is packed once and
every variant of the program reads it, so all variants must agree on its format. A candidate is
chosen only if it is faster at every count measured and, first, gives the baseline's numbers (an
int8 kernel that saturates on this CPU is never chosen).
"""

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch._guards import detect_fake_mode

from kiln.kernels import packed_linear
from kiln.passes.kernel_choice import time_call

logger = logging.getLogger(__name__)

aten, ops = torch.ops.aten, torch.ops.kiln

MAX_MEASURED_TOKENS = 256
"""The largest token count a GEMM is timed at (a prefill chunk): larger ones rank the same, slowly."""
DECODE_TOKENS = 16
"""A mid-sized decode batch, timed between the compile's bounds."""
STREAM_BYTES = 96 << 20
"""Weights are timed as a model reads them, from memory: enough copies to overflow the CPU's caches."""
TIME_BUDGET_S = 0.25
"""About how long one candidate is timed at one token count."""


@dataclass(frozen=True)
class GemmChoice:
    """One weight signature's decision: the median milliseconds of each candidate at each count."""

    kind: str  # "float" (mm/addmm), "int8" or "fp8" (scaled_mm)
    shape: tuple[int, int]  # the weight's [N, K]
    dtype: str
    kernel: str  # "aten" (the weight as loaded) or the name of the packed format chosen
    tokens: tuple[int, ...]
    ms: dict[str, tuple[float, ...]]
    calls: int = 0
    rejected: dict[str, str] = field(default_factory=dict)
    """Candidates not timed, and why (unavailable, or numbers that differ from the baseline's)."""

    def as_dict(self) -> dict:
        return asdict(self)


def measured_tokens(max_num_tokens: int) -> tuple[int, ...]:
    """1, a decode batch and a prefill chunk, within the compile's max_num_tokens."""
    return tuple(sorted({1, min(DECODE_TOKENS, max_num_tokens), min(MAX_MEASURED_TOKENS, max_num_tokens)}))


@dataclass(frozen=True)
class _Signature:
    kind: str
    shape: tuple[int, int]
    dtype: torch.dtype
    bias: bool
    out_dtype: torch.dtype | None = None  # scaled_mm's


Timer = Callable[[Callable, Sequence], float]


class GemmChooser:
    """Rewrites a graph's projections to the kernels that measure fastest. Signatures measured once
    are remembered, so every variant of one compile gets the same decisions."""

    def __init__(self, tokens: Sequence[int], timer: Timer | None = None):
        self.tokens = tuple(tokens)
        self.timer = timer
        self._decided: dict[_Signature, GemmChoice] = {}

    def __call__(self, graph: fx.Graph) -> tuple[list[GemmChoice], dict[str, str]]:
        """Rewrite `graph` in place; returns this graph's choices and each packed weight's format
        by placeholder target."""
        sites: dict[_Signature, list[tuple[fx.Node, fx.Node]]] = {}
        for node in list(graph.nodes):
            site = _site(node)
            if site is not None:
                sig, weight = site
                sites.setdefault(sig, []).append((node, weight))
        formats: dict[str, str] = {}
        choices = []
        for sig, nodes in sites.items():
            nodes = [(n, w) for n, w in nodes if _only_read_by_gemms(w)]
            if not nodes:
                continue
            choice = self.choose(sig)
            choices.append(_with_calls(choice, len(nodes)))
            packed = choice.kernel != "aten"
            if not packed and sig.kind != "int8":  # torch's GEMM is what the graph calls already
                continue
            for node, weight in nodes:
                _REWRITES[sig.kind](graph, node, weight, packed)
                if packed:
                    formats[weight.target] = choice.kernel
        return choices, formats

    def choose(self, sig: _Signature) -> GemmChoice:
        if sig not in self._decided:
            start = time.perf_counter()
            self._decided[sig] = choice = _measure(sig, self.tokens, self.timer or _streamed_time)
            logger.info("GEMM %s %s %s: %s (%s; %.1fs)", sig.kind, list(sig.shape), str(sig.dtype).removeprefix("torch."),
                        choice.kernel, ", ".join(f"{k} {'/'.join(f'{v:.3f}' for v in ms)} ms"
                                                 for k, ms in choice.ms.items()), time.perf_counter() - start)
        return self._decided[sig]


def lm_head_choice(weight: torch.Tensor, tokens: Sequence[int], timer: Timer | None = None) -> GemmChoice:
    """The same decision for the LM head's weight, which runs outside the compiled graph."""
    return _measure(_Signature("float", tuple(weight.shape), weight.dtype, False), tuple(tokens),
                    timer or _streamed_time)


def _with_calls(choice: GemmChoice, calls: int) -> GemmChoice:
    return GemmChoice(**{**asdict(choice), "calls": calls})


def _site(node: fx.Node) -> tuple[_Signature, fx.Node] | None:
    """A projection of a weight input on the CPU: (its signature, the weight's placeholder)."""
    if node.op != "call_function":
        return None
    if node.target is ops.scaled_mm.default:
        weight = node.args[1]
        if not _is_cpu_input(weight):
            return None
        val = weight.meta["val"]
        kind = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}.get(val.dtype)
        bias = len(node.args) > 5 and node.args[5] is not None or node.kwargs.get("bias") is not None
        return (_Signature(kind, tuple(val.shape), val.dtype, bias, node.args[4]), weight) if kind else None
    if node.target is aten.mm.default:
        transposed, bias = node.args[1], False
    elif node.target is aten.addmm.default and not node.kwargs:
        transposed, bias = node.args[2], True
    else:
        return None
    weight = _transposed_weight(transposed)
    if weight is None or not weight.meta["val"].dtype.is_floating_point:
        return None
    val = weight.meta["val"]
    return _Signature("float", tuple(val.shape), val.dtype, bias), weight


def _is_cpu_input(node) -> bool:
    if not (isinstance(node, fx.Node) and node.op == "placeholder"):
        return False
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() == 2 and val.device.type == "cpu" and \
        all(isinstance(s, int) for s in val.shape)


def _transposed_weight(node) -> fx.Node | None:
    """The weight placeholder `node` transposes (`t(w)` or `permute(w, [1, 0])`), else None."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return None
    if node.target is aten.t.default or (node.target is aten.permute.default and list(node.args[1]) == [1, 0]):
        return node.args[0] if _is_cpu_input(node.args[0]) else None
    return None


def _only_read_by_gemms(weight: fx.Node) -> bool:
    """A packed weight is opaque: every reader must be a projection this pass rewrites."""
    for user in weight.users:
        if user.target is ops.scaled_mm.default and user.args[1] is weight:
            continue
        if _transposed_weight(user) is weight and all(_site(u) is not None for u in user.users):
            continue
        return False
    return True


def _insert(graph: fx.Graph, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """A new call node with its fake value computed from its inputs'."""
    kwargs = kwargs or {}
    node = graph.call_function(target, args, kwargs)
    vals, kwvals = fx.node.map_arg((args, kwargs), lambda n: n.meta["val"])
    with detect_fake_mode([v for v in pytree.tree_leaves((vals, kwvals)) if isinstance(v, torch.Tensor)]):
        node.meta["val"] = target(*vals, **kwvals)
    return node


def _rewrite_float(graph: fx.Graph, node: fx.Node, weight: fx.Node, packed: bool = True) -> None:
    x, bias = (node.args[0], None) if node.target is aten.mm.default else (node.args[1], node.args[0])
    transposed = node.args[1] if node.target is aten.mm.default else node.args[2]
    with graph.inserting_before(node):
        new = _insert(graph, ops.onednn_linear.default, (x, weight, bias))
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    if not transposed.users:  # a transpose of the packed (opaque) weight must not run
        graph.erase_node(transposed)


def _scaled_mm_args(node: fx.Node) -> tuple:
    names = ("a", "b", "a_scale", "b_scale", "out_dtype", "bias")
    values = dict(zip(names, node.args)) | dict(node.kwargs)
    return tuple(values.get(n) for n in names)


def _epilogue(graph: fx.Graph, out: fx.Node, a_scale: fx.Node, b_scale: fx.Node, bias,
              out_dtype: torch.dtype) -> fx.Node:
    """fp32 product -> * the activation's scale, * the weight's per channel, + bias, in the output
    dtype (`scaled_mm`'s own order, so its numbers): aten ops Inductor fuses into the projection's reader."""
    out = _insert(graph, aten.mul.Tensor, (out, a_scale))
    out = _insert(graph, aten.mul.Tensor, (out, b_scale))
    if bias is not None:
        out = _insert(graph, aten.add.Tensor, (out, bias))
    if out_dtype != torch.float32:
        out = _insert(graph, aten._to_copy.default, (out,), {"dtype": out_dtype})
    return out


def _rewrite_int8(graph: fx.Graph, node: fx.Node, weight: fx.Node, packed: bool) -> None:
    """scaled_mm => the int8 GEMM (oneDNN's on the packed weight, else torch._int_mm, which AOTInductor
    calls from C++ with no Python op around it) and its epilogue in the graph, for Inductor to fuse."""
    a, _, a_scale, b_scale, out_dtype, bias = _scaled_mm_args(node)
    with graph.inserting_before(node):
        if packed:
            wide = _insert(graph, aten._to_copy.default, (a,), {"dtype": torch.int16})
            shifted = _insert(graph, aten.add.Tensor, (wide, packed_linear.INT8_ZERO_POINT))
            codes = _insert(graph, aten._to_copy.default, (shifted,), {"dtype": torch.uint8})
            out = _insert(graph, ops.onednn_int8_linear.default, (codes, weight))
        else:
            transposed = _insert(graph, aten.t.default, (weight,))
            sums = _insert(graph, aten._int_mm.default, (a, transposed))
            out = _insert(graph, aten._to_copy.default, (sums,), {"dtype": torch.float32})
        out = _epilogue(graph, out, a_scale, b_scale, bias, out_dtype)
    node.replace_all_uses_with(out)
    graph.erase_node(node)


def _rewrite_fp8(graph: fx.Graph, node: fx.Node, weight: fx.Node, packed: bool = True) -> None:
    a, _, a_scale, b_scale, out_dtype, bias = _scaled_mm_args(node)
    with graph.inserting_before(node):
        wide = _insert(graph, aten._to_copy.default, (a,), {"dtype": torch.float32})
        out = _insert(graph, ops.onednn_linear.default, (wide, weight, None))
        out = _epilogue(graph, out, a_scale, b_scale, bias, out_dtype)
    node.replace_all_uses_with(out)
    graph.erase_node(node)


_REWRITES = {"float": _rewrite_float, "int8": _rewrite_int8, "fp8": _rewrite_fp8}
_CANDIDATES = {"float": "onednn", "int8": "onednn_int8", "fp8": "onednn_fp8_as_fp32"}


def _streamed_time(fn: Callable, args: Sequence) -> float:
    """Median ms of `fn(*args)`, with a number of repeats that keeps the timing near TIME_BUDGET_S."""
    start = time.perf_counter()
    fn(*args)
    once = time.perf_counter() - start
    return time_call(fn, args, repeats=max(3, min(20, int(TIME_BUDGET_S / max(once, 1e-6)))))


def _measure(sig: _Signature, tokens: tuple[int, ...], timer: Timer) -> GemmChoice:
    """Time the baseline and the packed candidate at each token count, on random weights in enough
    copies to stream from memory as a model's do."""
    n, k = sig.shape
    candidate = _CANDIDATES[sig.kind]
    generator = torch.Generator().manual_seed(n * 31 + k)
    copies = max(1, min(16, math.ceil(STREAM_BYTES / (n * k * sig.dtype.itemsize))))
    plain = [_random_weight(sig, generator) for _ in range(copies)]
    scale = torch.rand(n, generator=generator) * 0.01 + 1e-3
    bias = torch.randn(n, generator=generator).to(_act_dtype(sig)) if sig.bias else None
    rejected = {}
    if not torch.backends.mkldnn.is_available():
        rejected[candidate] = "this torch is built without oneDNN"
    elif sig.kind == "int8" and not packed_linear.int8_gemm_exact():
        rejected[candidate] = "oneDNN's int8 GEMM saturates on this CPU (no VNNI)"
    packed = []
    if not rejected:
        try:
            packed = [packed_linear.pack(candidate, w) for w in plain]
        except RuntimeError as e:
            rejected[candidate] = f"packing failed: {e}"
    runs = {"aten": _runner(sig, "aten", plain, scale, bias)}
    if packed:
        runs[candidate] = _runner(sig, candidate, packed, scale, bias)
        problem = _differs(sig, runs, generator)
        if problem:
            rejected[candidate] = problem
            del runs[candidate]
    ms: dict[str, list[float]] = {name: [] for name in runs}
    for t in tokens:
        x = _random_input(sig, t, generator)
        for name, run in runs.items():
            ms[name].append(timer(run, x))
    faster = candidate in ms and all(c < b for c, b in zip(ms[candidate], ms["aten"]))
    return GemmChoice(sig.kind, sig.shape, str(sig.dtype).removeprefix("torch."), candidate if faster else "aten",
                      tokens, {k: tuple(round(v, 4) for v in vs) for k, vs in ms.items()}, rejected=rejected)


def _act_dtype(sig: _Signature) -> torch.dtype:
    return sig.dtype if sig.kind == "float" else sig.out_dtype


def _random_weight(sig: _Signature, generator: torch.Generator) -> torch.Tensor:
    n, k = sig.shape
    if sig.kind == "int8":
        return torch.randint(-127, 128, (n, k), generator=generator, dtype=torch.int8)
    w = torch.randn(n, k, generator=generator) * 0.05
    return w.to(sig.dtype)


def _random_input(sig: _Signature, tokens: int, generator: torch.Generator) -> list:
    k = sig.shape[1]
    if sig.kind == "float":
        return [torch.randn(tokens, k, generator=generator).to(sig.dtype)]
    codes = torch.randint(-127, 128, (tokens, k), generator=generator, dtype=torch.int8)
    if sig.kind == "fp8":
        codes = (torch.randn(tokens, k, generator=generator) * 50).to(torch.float8_e4m3fn)
    return [codes, torch.rand(tokens, 1, generator=generator) * 0.01 + 1e-4]


def _runner(sig: _Signature, kernel: str, weights: list[torch.Tensor], scale: torch.Tensor,
            bias: torch.Tensor | None) -> Callable:
    """A call of `kernel` on its inputs that reads the next weight copy each time."""
    turn = [0]

    def weight() -> torch.Tensor:
        turn[0] = (turn[0] + 1) % len(weights)
        return weights[turn[0]]

    if sig.kind == "float":
        if kernel == "aten":
            return (lambda x: torch.addmm(bias, x, weight().t())) if bias is not None else (lambda x: x @ weight().t())
        return lambda x: ops.onednn_linear(x, weight(), bias)
    if sig.kind == "int8":  # the GEMMs alone: the graph fuses the shift and the epilogue into other loops
        if kernel == "aten":
            return lambda a, s: torch._int_mm(a, weight().t())
        return lambda a, s: ops.onednn_int8_linear(packed_linear.shift_int8(a), weight())
    if kernel == "aten":
        return lambda a, s: ops.scaled_mm(a, weight(), s, scale, sig.out_dtype, bias)

    def finish(out: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        out = out * s * scale
        return (out + bias if bias is not None else out).to(sig.out_dtype)

    return lambda a, s: finish(ops.onednn_linear(a.float(), weight(), None), s)


def _differs(sig: _Signature, runs: dict[str, Callable], generator: torch.Generator) -> str | None:
    """Why the candidate's numbers are not the baseline's (both on the same weight copy), or None."""
    x = _random_input(sig, 7, generator)
    if sig.kind == "int8":  # the extreme codes, where a saturating kernel goes wrong
        x[0] = torch.where(torch.rand(x[0].shape, generator=generator) < 0.5, 127, -127).to(torch.int8)
    ref, got = (run(*x).float() for run in runs.values())
    tolerance = 1e-4 if sig.dtype.itemsize >= 4 or sig.kind != "float" else 2e-2
    err = ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
    if sig.kind == "fp8" or _act_dtype(sig) != torch.float32:
        tolerance = max(tolerance, 1e-2)
    return None if err <= tolerance else f"differs from torch's GEMM (relative error {err:.2g} > {tolerance:g})"
