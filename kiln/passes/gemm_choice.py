"""Which kernel runs each projection on CPU: torch's GEMM on the weight as loaded (what Inductor calls
for `mm`/`addmm`, and `kiln::scaled_mm`'s native form), or a kernel on a weight the runtime packs once
at load (`kiln.kernels.packed_linear`: oneDNN's float and int8 GEMMs, fbgemm's int8 GEMM, kiln's fp32
and int8 panel GEMMs). Decided by measurement per weight shape and kind, and recorded with the format
each weight input takes.

Each size range is decided at its own token counts (its bounds, and a decode batch of 16 where the
range holds it), the way the CUDA kernel choice is: small decode batches read weights and large ones
compute, and the kernel that wins differs. On CPU the compile cuts the dynamic token range after
SMALL_BATCH and DECODE_BATCH tokens for that; ranges whose decisions agree share one graph. A
candidate must first give the baseline's numbers (an int8 kernel that saturates on this CPU is never
chosen); of those faster than the baseline at every count measured, the fastest in total wins. fp8
weights are always widened and packed once (torch's form widens them on every call); projections
too small to time apart keep torch's GEMM. A later range keeps an earlier range's packed format where
that still beats torch's GEMM, so a weight is packed once where it can be; where the earlier format
loses there (kiln's int8 panel GEMM on prefill chunks), the weight is held in both forms, or both
formats.
"""

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.utils._pytree as pytree
from torch import fx
from torch._guards import detect_fake_mode

from kiln.kernels import packed_linear, panel_linear

logger = logging.getLogger(__name__)

aten, ops = torch.ops.aten, torch.ops.kiln

MAX_MEASURED_TOKENS = 256
"""The largest token count a GEMM is timed at (a prefill chunk): larger ones rank the same, slowly."""
DECODE_TOKENS = 16
"""A mid-sized decode batch, timed inside a range that holds it."""
SMALL_BATCH = 8
"""On CPU the dynamic token range is cut after this many tokens, so small decode batches (where a
GEMM reads its weight once and per-call costs count) choose their kernels apart from the rest."""
DECODE_BATCH = 32
"""...and after this many, so larger decode batches choose apart from prefill chunks (where a GEMM
computes more than it reads, and the fastest kernel at 256 tokens can be the slowest at 16)."""
BATCH_CUTS = (SMALL_BATCH, DECODE_BATCH)
STREAM_BYTES = 96 << 20
"""Weights are timed as a model reads them, from memory: enough copies to overflow the CPU's caches
(at most MAX_COPIES: a model of weights that small stays in the caches when it runs, too)."""
MAX_COPIES = 32
MIN_TIMED_ELEMENTS = 1 << 19
"""A projection of fewer weight elements (N x K) takes microseconds with either kernel: its timing is
noise (it would pick kernels, and split variants, at random), so torch's GEMM is kept untimed."""
TIME_BUDGET_S = 0.1
"""About how long one candidate is timed at one token count."""


@dataclass(frozen=True)
class GemmChoice:
    """One weight signature's decision: the median milliseconds of each candidate at each count."""

    kind: str  # "float" (mm/addmm), "int8", "w7a8" (int8 with 7-bit weight codes) or "fp8" (scaled_mm)
    shape: tuple[int, int]  # the weight's [N, K]
    dtype: str
    kernel: str  # "aten" (the weight as loaded), "widened" (int8), or the name of the packed format chosen
    tokens: tuple[int, ...]
    ms: dict[str, tuple[float, ...]]
    calls: int = 0
    rejected: dict[str, str] = field(default_factory=dict)
    """Candidates not timed, and why (unavailable, or numbers that differ from the baseline's)."""

    def as_dict(self) -> dict:
        return asdict(self)


def measured_tokens(size_range: tuple[int, int]) -> tuple[int, ...]:
    """A range's bounds (the upper clipped to a prefill chunk) and a decode batch of 16 if it holds one."""
    low, high = size_range
    inside = {DECODE_TOKENS} if low < DECODE_TOKENS < high else set()
    return tuple(sorted({low, min(high, max(low, MAX_MEASURED_TOKENS))} | inside))


def split_at_batch_cuts(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """`ranges` with any range holding both c and c + 1, for c in BATCH_CUTS, cut between them."""
    for cut in BATCH_CUTS:
        out = []
        for low, high in ranges:
            out += [(low, cut), (cut + 1, high)] if low <= cut < high else [(low, high)]
        ranges = out
    return ranges


@dataclass(frozen=True)
class _Signature:
    kind: str
    shape: tuple[int, int]
    dtype: torch.dtype
    bias: bool
    out_dtype: torch.dtype | None = None  # scaled_mm's


Timer = Callable[[Callable, Sequence], float]
"""timer(fn, args) -> milliseconds of fn(*args); `fn.kernel` names the kernel it calls (see GemmChoice.kernel)."""


INT8_KINDS = ("int8", "w7a8")


class GemmChooser:
    """Rewrites a graph's projections to the kernels that measure fastest for a size range. Each
    (signature, token counts) is measured once per compile and remembered. `quantization` is the
    model's scheme: "w7a8" weights are int8 tensors whose codes admit more kernels."""

    def __init__(self, timer: Timer | None = None, quantization: str | None = None):
        self.timer = timer
        self.int8_kind = "w7a8" if quantization == "w7a8" else "int8"
        self._decided: dict[tuple[_Signature, tuple[int, ...]], GemmChoice] = {}
        self._held: dict[_Signature, str] = {}  # each signature's packed format, once one is chosen

    def decisions(self, graph: fx.Graph, size_range: tuple[int, int]) -> tuple[tuple[_Signature, str], ...]:
        """Each projection signature in `graph` and the kernel it gets for `size_range` (measured
        now if new): what tells whether two ranges can share one graph."""
        tokens = measured_tokens(size_range)
        return tuple((sig, self.choose(sig, tokens).kernel) for sig in _sites(graph, self.int8_kind))

    def __call__(self, graph: fx.Graph, size_range: tuple[int, int]) -> tuple[list[GemmChoice], dict[str, str]]:
        """Rewrite `graph` in place for `size_range`; returns its choices and each packed weight's
        format by placeholder target."""
        tokens = measured_tokens(size_range)
        formats: dict[str, str] = {}
        choices = []
        for sig, nodes in _sites(graph, self.int8_kind).items():
            choice = self.choose(sig, tokens)
            choices.append(_with_calls(choice, len(nodes)))
            packed = choice.kernel in packed_linear.FORMATS
            if not packed and sig.kind not in INT8_KINDS:  # torch's GEMM is what the graph calls already
                continue
            for node, weight in nodes:
                _REWRITES[sig.kind](graph, node, weight, choice.kernel)
                if packed:
                    formats[weight.target] = choice.kernel
        return choices, formats

    def choose(self, sig: _Signature, tokens: tuple[int, ...]) -> GemmChoice:
        if (sig, tokens) not in self._decided:
            start = time.perf_counter()
            choice = self._one_packed_format(sig, _measure(sig, tokens, self.timer or _streamed_time))
            self._decided[sig, tokens] = choice
            logger.info("GEMM %s %s %s at %s tokens: %s (%s; %.1fs)", sig.kind, list(sig.shape),
                        str(sig.dtype).removeprefix("torch."), list(tokens), choice.kernel,
                        ", ".join(f"{k} {'/'.join(f'{v:.3f}' for v in ms)} ms" for k, ms in choice.ms.items()),
                        time.perf_counter() - start)
        return self._decided[sig, tokens]

    def _one_packed_format(self, sig: _Signature, choice: GemmChoice) -> GemmChoice:
        """Where a later size range measures another packed kernel fastest, keep the format an earlier
        range chose (the decode batches', ranges being decided in order) if that still beats torch's
        GEMM there. Two formats hold the weight twice and pack it twice at every start (on the fp32
        0.5B shape: 1.4 GB and 4 s instead of 2 s)."""
        if choice.kernel not in packed_linear.FORMATS:
            return choice
        held = self._held.setdefault(sig, choice.kernel)
        if held == choice.kernel or held not in choice.ms or \
                not all(t < b for t, b in zip(choice.ms[held], choice.ms["aten"])):
            return choice
        why = f"faster here, but the weight is packed as {held} for other token counts (one copy)"
        return replace(choice, kernel=held, rejected={**choice.rejected, choice.kernel: why})


def _sites(graph: fx.Graph, int8_kind: str = "int8") -> dict[_Signature, list[tuple[fx.Node, fx.Node]]]:
    """The projections of weight inputs that only projections read, by signature: (node, weight)."""
    sites: dict[_Signature, list[tuple[fx.Node, fx.Node]]] = {}
    for node in graph.nodes:
        site = _site(node, int8_kind)
        if site is not None and _only_read_by_gemms(site[1]):
            sites.setdefault(site[0], []).append((node, site[1]))
    return sites


def lm_head_choice(weight: torch.Tensor, tokens: Sequence[int], timer: Timer | None = None) -> GemmChoice:
    """The same decision for the LM head's weight, which runs outside the compiled graph: a panel GEMM
    chosen for it ships as a library of its own (`kiln.compiler.head_library`)."""
    return _measure(_Signature("float", tuple(weight.shape), weight.dtype, False), tuple(tokens),
                    timer or _streamed_time, candidates=("onednn", "panels16"))


def lm_head_screen_choice(shape: tuple[int, int], tokens: Sequence[int], timer: Timer | None = None) -> GemmChoice:
    """The int8 GEMM of the LM head's greedy screen (`kiln.models.lm_head.GreedyScreen`), on int8
    codes of the head's [vocab, hidden] shape: oneDNN's or kiln's panel GEMM, whichever is faster
    over the token counts. torch's GEMM is timed (and checks their numbers) but is no choice: the
    screen never runs on it, so it cannot veto one that is slower at one count and faster overall."""
    return _measure(_Signature("int8", tuple(shape), torch.int8, False, torch.float32), tuple(tokens),
                    timer or _streamed_time, candidates=("onednn_int8", "panels16_int8"), baseline=False)


def _with_calls(choice: GemmChoice, calls: int) -> GemmChoice:
    return GemmChoice(**{**asdict(choice), "calls": calls})


def _site(node: fx.Node, int8_kind: str = "int8") -> tuple[_Signature, fx.Node] | None:
    """A projection of a weight input on the CPU: (its signature, the weight's placeholder); int8
    weights are of `int8_kind`."""
    if node.op != "call_function":
        return None
    if node.target is ops.scaled_mm.default:
        weight = node.args[1]
        if not _is_cpu_input(weight):
            return None
        val = weight.meta["val"]
        kind = {torch.int8: int8_kind, torch.float8_e4m3fn: "fp8"}.get(val.dtype)
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


def _rewrite_float(graph: fx.Graph, node: fx.Node, weight: fx.Node, kernel: str) -> None:
    x, bias = (node.args[0], None) if node.target is aten.mm.default else (node.args[1], node.args[0])
    transposed = node.args[1] if node.target is aten.mm.default else node.args[2]
    op = ops.panel_linear.default if kernel == "panels16" else ops.onednn_linear.default
    with graph.inserting_before(node):
        new = _insert(graph, op, (x, weight, bias))
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


def _rewrite_int8(graph: fx.Graph, node: fx.Node, weight: fx.Node, kernel: str) -> None:
    """scaled_mm => the int8 GEMM (oneDNN's or fbgemm's on the packed weight, else torch._int_mm, which
    AOTInductor calls from C++ with no Python op around it) and its epilogue in the graph, for
    Inductor to fuse."""
    a, _, a_scale, b_scale, out_dtype, bias = _scaled_mm_args(node)
    with graph.inserting_before(node):
        if kernel == "fbgemm_w7a8":  # packed_linear.fbgemm_w7a8_linear
            rows = _insert(graph, aten._to_copy.default, (a,), {"dtype": torch.float32})
            out = _insert(graph, ops.fbgemm_rows_linear.default, (rows, weight, packed_linear.W7A8_ZERO_POINT))
        elif kernel == "fbgemm_int8":  # packed_linear.fbgemm_int8_linear, its split and join in the graph
            half = _insert(graph, aten.div.Tensor_mode, (a, 2), {"rounding_mode": "floor"})
            rest = _insert(graph, aten.sub.Tensor, (a, _insert(graph, aten.mul.Tensor, (half, 2))))
            halves = _insert(graph, aten.cat.default, ([half, rest],))
            rows = _insert(graph, aten._to_copy.default, (halves,), {"dtype": torch.float32})
            sums = _insert(graph, aten.view.default, (_insert(graph, ops.fbgemm_rows_linear.default, (rows, weight)),
                                                      [2, -1, weight.meta["val"].shape[0]]))
            hi, lo = (_insert(graph, aten.select.int, (sums, 0, i)) for i in (0, 1))
            out = _insert(graph, aten.add.Tensor, (_insert(graph, aten.mul.Tensor, (hi, 2)), lo))
        elif kernel == "widened":
            wide = _insert(graph, aten._to_copy.default, (weight,), {"dtype": torch.float32})
            rows = _insert(graph, aten._to_copy.default, (a,), {"dtype": torch.float32})
            out = _insert(graph, aten.mm.default, (rows, _insert(graph, aten.t.default, (wide,))))
        elif kernel == "panels16_int8":
            out = _insert(graph, ops.panel_int8_linear.default, (a, weight))
        elif kernel == "onednn_int8":
            # through int32, not int16: Inductor vectorizes int32 casts, int16's run as a scalar loop
            wide = _insert(graph, aten._to_copy.default, (a,), {"dtype": torch.int32})
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


def _rewrite_fp8(graph: fx.Graph, node: fx.Node, weight: fx.Node, kernel: str) -> None:
    a, _, a_scale, b_scale, out_dtype, bias = _scaled_mm_args(node)
    with graph.inserting_before(node):
        wide = _insert(graph, aten._to_copy.default, (a,), {"dtype": torch.float32})
        out = _insert(graph, ops.onednn_linear.default, (wide, weight, None))
        out = _epilogue(graph, out, a_scale, b_scale, bias, out_dtype)
    node.replace_all_uses_with(out)
    graph.erase_node(node)


_REWRITES = {"float": _rewrite_float, "int8": _rewrite_int8, "w7a8": _rewrite_int8, "fp8": _rewrite_fp8}
_CANDIDATES = {"float": ("onednn", "panels16"),
               "int8": ("onednn_int8", "fbgemm_int8", "panels16_int8", "widened"),
               "w7a8": ("onednn_int8", "fbgemm_w7a8", "panels16_int8", "widened"), "fp8": ("onednn_fp8_as_fp32",)}
"""Per kind, the kernels tried against torch's GEMM: packed formats (`packed_linear.FORMATS`; "panels16"
and "panels16_int8" are kiln's GEMMs for decode batches, timed as built alone, run compiled into the
piece; "w7a8" weights run fbgemm's int8 GEMM without the split that 8-bit codes need, and oneDNN's
exactly on CPUs without VNNI, where it beats fbgemm on prefill chunks), and for int8 "widened", codes
widened to fp32 per call for torch's float GEMM (exact: integer products, and sums as exact as the
int32 ones converted): where a CPU's int8 GEMMs are slow, large prefill chunks compute faster so."""


def _streamed_time(fn: Callable, args: Sequence) -> float:
    """The fastest of a few calls of `fn(*args)`, in ms, as many as fit in about TIME_BUDGET_S. The
    least, not the median: on a shared machine other work only ever adds time, and the kernels being
    compared run alike."""
    fn(*args)  # warm-up: first-call costs (oneDNN builds its primitive)
    times = []
    while len(times) < 3 or (sum(times) < TIME_BUDGET_S and len(times) < 50):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def _code_max(sig: _Signature) -> int:
    """The largest weight code of an int8 kind: 7-bit for w7a8."""
    return packed_linear.W7A8_MAX if sig.kind == "w7a8" else 127


def _unavailable(sig: _Signature, candidate: str) -> str | None:
    """Why `candidate` cannot run `sig` on this CPU and torch, or None."""
    if candidate.startswith("onednn") and not torch.backends.mkldnn.is_available():
        return "this torch is built without oneDNN"
    if candidate == "onednn_int8" and not packed_linear.int8_gemm_exact(_code_max(sig)):
        return "oneDNN's int8 GEMM saturates on this CPU (no VNNI)"
    if candidate.startswith("fbgemm") and not packed_linear.fbgemm_available():
        return "this torch has no fbgemm quantized linear"
    if candidate.startswith("panels16"):
        from kiln.compiler import panel_lowering

        if not panel_lowering.register():
            return "this torch's Inductor cannot compile the panel GEMMs into a piece"
        return panel_linear.available(sig.shape, sig.dtype)
    return None


def _measure(sig: _Signature, tokens: tuple[int, ...], timer: Timer,
             candidates: tuple[str, ...] | None = None, baseline: bool = True) -> GemmChoice:
    """Time the baseline and each packed candidate (default: the kind's) at each token count, on
    random weights in enough copies to stream from memory as a model's do; the fastest candidate
    (least summed time) faster than the baseline at every count wins, or with `baseline=False` the
    fastest candidate."""
    n, k = sig.shape
    dtype = str(sig.dtype).removeprefix("torch.")
    candidates = candidates or _CANDIDATES[sig.kind]
    if sig.kind != "fp8" and n * k < MIN_TIMED_ELEMENTS:
        return GemmChoice(sig.kind, sig.shape, dtype, "aten", tokens, {},
                          rejected={c: f"{n} x {k} weights: too small to time apart" for c in candidates})
    generator = torch.Generator().manual_seed(n * 31 + k)
    copies = max(1, min(MAX_COPIES, math.ceil(STREAM_BYTES / (n * k * sig.dtype.itemsize))))
    first = _random_weight(sig, generator)
    plain = [first] + [first.clone() for _ in range(copies - 1)]  # copies stream as distinct weights would
    scale = torch.rand(n, generator=generator) * 0.01 + 1e-3
    bias = torch.randn(n, generator=generator).to(_act_dtype(sig)) if sig.bias else None
    rejected: dict[str, str] = {}
    runs = {"aten": _labelled("aten", _runner(sig, "aten", plain, scale, bias))}
    for candidate in candidates:
        problem = _unavailable(sig, candidate)
        if problem is None:
            try:
                packed = [packed_linear.pack(candidate, w) for w in plain] \
                    if candidate in packed_linear.FORMATS else plain
            except RuntimeError as e:
                problem = f"packing failed: {e}"
        if problem is None:
            runs[candidate] = _labelled(candidate, _runner(sig, candidate, packed, scale, bias))
            problem = _differs(sig, {"aten": runs["aten"], candidate: runs[candidate]}, generator)
        if problem is not None:
            rejected[candidate] = problem
            runs.pop(candidate, None)
    if sig.kind == "fp8":  # no timing needed: torch's form widens the whole weight on every call
        return GemmChoice(sig.kind, sig.shape, dtype, next((c for c in candidates if c in runs), "aten"), tokens, {},
                          rejected=rejected)
    ms: dict[str, list[float]] = {name: [] for name in runs}
    for t in tokens:
        x = _random_input(sig, t, generator)
        for name, run in runs.items():
            ms[name].append(timer(run, x))
    faster = [c for c in ms if c != "aten" and (not baseline or all(t < b for t, b in zip(ms[c], ms["aten"])))]
    kernel = min(faster, key=lambda c: sum(ms[c])) if faster else "aten"
    return GemmChoice(sig.kind, sig.shape, dtype, kernel, tokens,
                      {k: tuple(round(v, 4) for v in vs) for k, vs in ms.items()}, rejected=rejected)


def _act_dtype(sig: _Signature) -> torch.dtype:
    return sig.dtype if sig.kind == "float" else sig.out_dtype


def _random_weight(sig: _Signature, generator: torch.Generator) -> torch.Tensor:
    n, k = sig.shape
    if sig.kind in INT8_KINDS:
        top = _code_max(sig)
        return torch.randint(-top, top + 1, (n, k), generator=generator, dtype=torch.int8)
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


def _labelled(kernel: str, run: Callable) -> Callable:
    """`run` with the kernel it calls as its `kernel` attribute (what a stand-in timer reads)."""
    run.kernel = kernel
    return run


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
        if kernel == "panels16":
            gemm = panel_linear.timing_kernel()
            return lambda x: gemm(x, weight(), bias)
        return lambda x: ops.onednn_linear(x, weight(), bias)
    if sig.kind in INT8_KINDS:  # the GEMMs alone: the graph fuses the shift and the epilogue into other loops
        if kernel == "aten":
            return lambda a, s: torch._int_mm(a, weight().t())
        if kernel == "fbgemm_int8":
            return lambda a, s: packed_linear.fbgemm_int8_linear(a, weight())
        if kernel == "fbgemm_w7a8":
            return lambda a, s: packed_linear.fbgemm_w7a8_linear(a, weight())
        if kernel == "panels16_int8":
            gemm = panel_linear.timing_kernel(panel_linear.INT8)
            return lambda a, s: gemm(a, weight())
        if kernel == "widened":
            return lambda a, s: a.float() @ weight().float().t()
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
    if sig.kind in INT8_KINDS:  # the extreme codes, where a saturating kernel goes wrong
        x[0] = torch.where(torch.rand(x[0].shape, generator=generator) < 0.5, 127, -127).to(torch.int8)
    ref, got = (run(*x).float() for run in runs.values())
    tolerance = 1e-4 if sig.dtype.itemsize >= 4 or sig.kind != "float" else 2e-2
    err = ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
    if sig.kind == "fp8" or _act_dtype(sig) != torch.float32:
        tolerance = max(tolerance, 1e-2)
    return None if err <= tolerance else f"differs from torch's GEMM (relative error {err:.2g} > {tolerance:g})"
