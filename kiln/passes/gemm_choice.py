"""Which kernel runs each projection on CPU: torch's GEMM on the weight as loaded (what Inductor calls
for `mm`/`addmm`, and `kiln::scaled_mm`'s native form), or one of the candidates of
`kiln.kernels.gemms`, most on a weight the runtime packs once at load. Decided by measurement per
weight shape and kind, and recorded with the format each weight input takes. This pass only measures
and rewrites: what a candidate is, where it runs and what it becomes in the graph are its record's.

Each size range is decided at its own token counts (its bounds, and a decode batch of 16 where the
range holds it), the way the CUDA kernel choice is: small decode batches read weights and large ones
compute, and the kernel that wins differs. On CPU the compile cuts the dynamic token range after
SMALL_BATCH and DECODE_BATCH tokens for that; ranges whose decisions agree share one graph. A
candidate must first give the baseline's numbers (an int8 kernel that saturates on this CPU is never
chosen); of those faster than the baseline at every count measured, the fastest in total wins. fp8
weights are always widened and packed once (torch's form widens them on every call), and int4 weights
always run on kiln's W4A8 panel GEMM where it runs (AVX2 or AVX-512; torch's form dequantizes them on
every call); int8 weights with activation blocks (CPU int8) are timed on kiln's blocked int8 panel GEMM
against torch's form, which widens both operands for its float GEMM; projections
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

from kiln.kernels import gemms
from kiln.kernels.gemms import INT8_KINDS, GemmCandidate, Projection
from kiln.kernels.quant import ACT_BLOCK

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
BLOCKED_KINDS = ("int4", "int8_blocked", "int8_grouped")
"""Kinds whose activations have a scale per token and block of ACT_BLOCK."""
UNTIMED_KINDS = ("fp8", "int4", "int8_grouped")
"""Kinds whose torch form widens the whole weight on every call: the first candidate that runs wins, untimed."""
TIME_BUDGET_S = 0.1
"""About how long one candidate is timed at one token count."""


@dataclass(frozen=True)
class GemmChoice:
    """One weight signature's decision: the median milliseconds of each candidate at each count."""

    kind: str  # "float" (mm/addmm), "int8", "w7a8" (int8 with 7-bit weight codes), "fp8" (scaled_mm), "int4",
    # "int8_blocked" (int8 with activation blocks), "int8_grouped" (and weight scales per block)
    shape: tuple[int, int]  # the weight's [N, K]
    dtype: str
    kernel: str  # the id of the candidate chosen (`kiln.kernels.gemms`): a packed one's is its weight format
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


Timer = Callable[[Callable, Sequence], float]
"""timer(fn, args) -> milliseconds of fn(*args); `fn.kernel` names the kernel it calls (see GemmChoice.kernel)."""


class GemmChooser:
    """Rewrites a graph's projections to the kernels that measure fastest for a size range. Each
    (signature, token counts) is measured once per compile and remembered. `quantization` is the
    model's scheme: "w7a8" weights are int8 tensors whose codes admit more kernels."""

    def __init__(self, timer: Timer | None = None, quantization: str | None = None):
        self.timer = timer
        self.int8_kind = "w7a8" if quantization == "w7a8" else "int8"
        self._decided: dict[tuple[Projection, tuple[int, ...]], GemmChoice] = {}
        self._held: dict[Projection, str] = {}  # each signature's packed format, once one is chosen

    def decisions(self, graph: fx.Graph, size_range: tuple[int, int]) -> tuple[tuple[Projection, str], ...]:
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
            candidate = gemms.BY_ID[choice.kernel]
            if candidate is gemms.ATEN and sig.kind in ("float", "fp8"):  # what the graph calls already
                continue
            for node, weight in nodes:
                grouped = _group_scales(node) if choice.kernel in gemms.SCALE_FORMATS else ()
                _rewrite(graph, node, weight, candidate)
                if candidate.packed:
                    formats[weight.target] = choice.kernel
                for tensor in grouped:  # the weight's group scales (and int4's minimums)
                    formats[tensor.target] = gemms.SCALE_FORMATS[choice.kernel]
        return choices, formats

    def choose(self, sig: Projection, tokens: tuple[int, ...]) -> GemmChoice:
        if (sig, tokens) not in self._decided:
            start = time.perf_counter()
            choice = self._one_packed_format(sig, _measure(sig, tokens, self.timer or _streamed_time))
            self._decided[sig, tokens] = choice
            logger.info("GEMM %s %s %s at %s tokens: %s (%s; %.1fs)", sig.kind, list(sig.shape),
                        str(sig.dtype).removeprefix("torch."), list(tokens), choice.kernel,
                        ", ".join(f"{k} {'/'.join(f'{v:.3f}' for v in ms)} ms" for k, ms in choice.ms.items())
                        or "not timed",
                        time.perf_counter() - start)
        return self._decided[sig, tokens]

    def _one_packed_format(self, sig: Projection, choice: GemmChoice) -> GemmChoice:
        """Where a later size range measures another packed kernel fastest, keep the format an earlier
        range chose (the decode batches', ranges being decided in order) if that still beats torch's
        GEMM there. Two formats would hold the weight twice and pack it twice at every start."""
        if choice.kernel not in gemms.FORMATS:
            return choice
        held = self._held.setdefault(sig, choice.kernel)
        if held == choice.kernel or held not in choice.ms or \
                not all(t < b for t, b in zip(choice.ms[held], choice.ms[gemms.ATEN.id])):
            return choice
        why = f"faster here, but the weight is packed as {held} for other token counts (one copy)"
        return replace(choice, kernel=held, rejected={**choice.rejected, choice.kernel: why})


def _sites(graph: fx.Graph, int8_kind: str = "int8") -> dict[Projection, list[tuple[fx.Node, fx.Node]]]:
    """The projections of weight inputs that only projections read, by signature: (node, weight)."""
    sites: dict[Projection, list[tuple[fx.Node, fx.Node]]] = {}
    for node in graph.nodes:
        site = _site(node, int8_kind)
        if site is not None and _only_read_by_gemms(site[1]):
            sites.setdefault(site[0], []).append((node, site[1]))
    return sites


def lm_head_choice(weight: torch.Tensor, tokens: Sequence[int], timer: Timer | None = None) -> GemmChoice:
    """The same decision for the LM head's weight, which runs outside the compiled graph: a panel GEMM
    chosen for it ships as a library of its own (`kiln.compiler.libraries`)."""
    return _measure(Projection("float", tuple(weight.shape), weight.dtype, False), tuple(tokens),
                    timer or _streamed_time, candidates=gemms.HEAD_CANDIDATES)


def lm_head_screen_choice(shape: tuple[int, int], tokens: Sequence[int], timer: Timer | None = None) -> GemmChoice:
    """The int8 GEMM of the LM head's greedy screen (`kiln.models.lm_head.GreedyScreen`), on int8
    codes of the head's [vocab, hidden] shape: oneDNN's or kiln's panel GEMM, whichever is faster
    over the token counts. torch's GEMM is timed (and checks their numbers) but is no choice: the
    screen never runs on it, so it cannot veto one that is slower at one count and faster overall."""
    return _measure(Projection("int8", tuple(shape), torch.int8, False, torch.float32), tuple(tokens),
                    timer or _streamed_time, candidates=gemms.SCREEN_CANDIDATES, baseline=False)


def _with_calls(choice: GemmChoice, calls: int) -> GemmChoice:
    return GemmChoice(**{**asdict(choice), "calls": calls})


def _site(node: fx.Node, int8_kind: str = "int8") -> tuple[Projection, fx.Node] | None:
    """A projection of a weight input on the CPU: (its signature, the weight's placeholder); int8
    weights are of `int8_kind`."""
    if node.op != "call_function":
        return None
    if node.target is ops.int4_block_mm.default:
        _, _, weight, scales, mins, out_dtype, bias = _int4_args(node)
        if not (_is_cpu_input(weight) and all(_is_cpu_input(t) and len(t.users) == 1 for t in (scales, mins))):
            return None  # (the panel GEMM packs the scales and minimums too: they must be inputs only this reads)
        val = weight.meta["val"]
        return Projection("int4", tuple(val.shape), val.dtype, bias is not None, out_dtype,
                          groups=scales.meta["val"].shape[1]), weight
    if node.target is ops.int8_block_mm.default:
        _, _, weight, b_scale, out_dtype, bias = _int8_block_args(node)
        if not _is_cpu_input(weight):
            return None
        val = weight.meta["val"]
        if b_scale.meta["val"].dim() == 2:  # a scale per block: the kernel packs them, which only it may read
            if not (_is_cpu_input(b_scale) and len(b_scale.users) == 1):
                return None
            return Projection("int8_grouped", tuple(val.shape), val.dtype, bias is not None, out_dtype,
                              groups=b_scale.meta["val"].shape[1]), weight
        return Projection("int8_blocked", tuple(val.shape), val.dtype, bias is not None, out_dtype), weight
    if node.target is ops.scaled_mm.default:
        weight = node.args[1]
        if not _is_cpu_input(weight):
            return None
        val = weight.meta["val"]
        kind = {torch.int8: int8_kind, torch.float8_e4m3fn: "fp8"}.get(val.dtype)
        bias = len(node.args) > 5 and node.args[5] is not None or node.kwargs.get("bias") is not None
        return (Projection(kind, tuple(val.shape), val.dtype, bias, node.args[4]), weight) if kind else None
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
    return Projection("float", tuple(val.shape), val.dtype, bias), weight


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
        if user.target is ops.scaled_mm.default and user.args[1] is weight or \
                user.target in (ops.int4_block_mm.default, ops.int8_block_mm.default) and user.args[2] is weight:
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


def _rewrite(graph: fx.Graph, node: fx.Node, weight: fx.Node, candidate: GemmCandidate) -> None:
    """`node` (mm/addmm, or scaled_mm) => `candidate`'s GEMM, and for scaled_mm its epilogue in the
    graph, for Inductor to fuse."""
    def insert(target, args: tuple, kwargs: dict | None = None) -> fx.Node:
        return _insert(graph, target, args, kwargs)

    with graph.inserting_before(node):
        if node.target is ops.int4_block_mm.default:
            a, a_scale, _, scales, mins, out_dtype, bias = _int4_args(node)
            out = _epilogue(graph, candidate.emit(insert, a, weight, (a_scale, scales, mins)), None, None, bias,
                            out_dtype)
        elif node.target is ops.int8_block_mm.default and _int8_block_args(node)[3].meta["val"].dim() == 2:
            a, a_scale, _, b_scale, out_dtype, bias = _int8_block_args(node)
            out = _epilogue(graph, candidate.emit(insert, a, weight, (a_scale, b_scale)), None, None, bias, out_dtype)
        elif node.target is ops.int8_block_mm.default:
            a, a_scale, _, b_scale, out_dtype, bias = _int8_block_args(node)
            out = _epilogue(graph, candidate.emit(insert, a, weight, a_scale), None, b_scale, bias, out_dtype)
        elif node.target is ops.scaled_mm.default:
            a, _, a_scale, b_scale, out_dtype, bias = _scaled_mm_args(node)
            out = _epilogue(graph, candidate.emit(insert, a, weight, None), a_scale, b_scale, bias, out_dtype)
        else:
            x, bias = (node.args[0], None) if node.target is aten.mm.default else (node.args[1], node.args[0])
            out = candidate.emit(insert, x, weight, bias)
    transposed = None if node.target in (ops.scaled_mm.default, ops.int4_block_mm.default,
                                         ops.int8_block_mm.default) else \
        node.args[1] if node.target is aten.mm.default else node.args[2]
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    if transposed is not None and not transposed.users:  # a transpose of the packed (opaque) weight must not run
        graph.erase_node(transposed)


def _scaled_mm_args(node: fx.Node) -> tuple:
    names = ("a", "b", "a_scale", "b_scale", "out_dtype", "bias")
    values = dict(zip(names, node.args)) | dict(node.kwargs)
    return tuple(values.get(n) for n in names)


def _int4_args(node: fx.Node) -> tuple:
    names = ("a", "a_scale", "b", "b_scale", "b_min", "out_dtype", "bias")
    values = dict(zip(names, node.args)) | dict(node.kwargs)
    return tuple(values.get(n) for n in names)


def _group_scales(node: fx.Node) -> tuple:
    """The inputs a grouped kernel packs beside the weight: int4's scales and minimums, grouped int8's scales."""
    if node.target is ops.int4_block_mm.default:
        return _int4_args(node)[3:5]
    return (_int8_block_args(node)[3],)


def _int8_block_args(node: fx.Node) -> tuple:
    names = ("a", "a_scale", "b", "b_scale", "out_dtype", "bias")
    values = dict(zip(names, node.args)) | dict(node.kwargs)
    return tuple(values.get(n) for n in names)


def _epilogue(graph: fx.Graph, out: fx.Node, a_scale: fx.Node | None, b_scale: fx.Node | None, bias,
              out_dtype: torch.dtype) -> fx.Node:
    """fp32 product -> * the activation's scale, * the weight's per channel (int4: neither, both applied
    by block and group already), + bias, in the output dtype (`scaled_mm`'s own order, so its numbers): aten
    ops Inductor fuses into the projection's reader."""
    if a_scale is not None:
        out = _insert(graph, aten.mul.Tensor, (out, a_scale))
    if b_scale is not None:
        out = _insert(graph, aten.mul.Tensor, (out, b_scale))
    if bias is not None:
        out = _insert(graph, aten.add.Tensor, (out, bias))
    if out_dtype != torch.float32:
        out = _insert(graph, aten._to_copy.default, (out,), {"dtype": out_dtype})
    return out


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


def _measure(sig: Projection, tokens: tuple[int, ...], timer: Timer,
             candidates: tuple[GemmCandidate, ...] | None = None, baseline: bool = True) -> GemmChoice:
    """Time the baseline and each candidate (default: the kind's) at each token count, on random
    weights in enough copies to stream from memory as a model's do; the fastest candidate (least
    summed time) faster than the baseline at every count wins, or with `baseline=False` the fastest
    candidate."""
    n, k = sig.shape
    dtype = str(sig.dtype).removeprefix("torch.")
    candidates = candidates or gemms.for_kind(sig.kind)
    aten_id = gemms.ATEN.id
    if sig.kind not in UNTIMED_KINDS and n * k < MIN_TIMED_ELEMENTS:
        return GemmChoice(sig.kind, sig.shape, dtype, aten_id, tokens, {},
                          rejected={c.id: f"{n} x {k} weights: too small to time apart" for c in candidates})
    generator = torch.Generator().manual_seed(n * 31 + k)
    copies = max(1, min(MAX_COPIES, math.ceil(STREAM_BYTES / (n * k * sig.dtype.itemsize))))
    first = _random_weight(sig, generator)
    plain = [first] + [first.clone() for _ in range(copies - 1)]  # copies stream as distinct weights would
    scale = torch.rand(n, generator=generator) * 0.01 + 1e-3
    if sig.kind == "int4":  # the group scales and minimums, fp16 as stored
        scale = ((torch.rand(n, sig.groups, generator=generator) * 0.01 + 1e-3).half(),
                 (torch.rand(n, sig.groups, generator=generator) * -0.05).half())
    if sig.kind == "int8_grouped":  # the scales per block, fp16 as stored
        scale = (torch.rand(n, sig.groups, generator=generator) * 0.01 + 1e-3).half()
    bias = torch.randn(n, generator=generator).to(sig.act_dtype) if sig.bias else None
    rejected: dict[str, str] = {}
    runs = {aten_id: _runner(sig, gemms.ATEN, plain, scale, bias)}
    for candidate in candidates:
        problem = candidate.unavailable(sig)
        if problem is None:
            try:
                packed = [gemms.pack(candidate.id, w) for w in plain] if candidate.packed else plain
            except RuntimeError as e:
                problem = f"packing failed: {e}"
        if problem is None:
            runs[candidate.id] = _runner(sig, candidate, packed, scale, bias)
            problem = _differs(sig, {aten_id: runs[aten_id], candidate.id: runs[candidate.id]}, generator)
        if problem is not None:
            rejected[candidate.id] = problem
            runs.pop(candidate.id, None)
    if sig.kind in UNTIMED_KINDS:  # no timing needed: torch's form widens the whole weight on every call
        return GemmChoice(sig.kind, sig.shape, dtype, next((c.id for c in candidates if c.id in runs), aten_id),
                          tokens, {}, rejected=rejected)
    ms: dict[str, list[float]] = {name: [] for name in runs}
    for t in tokens:
        x = _random_input(sig, t, generator)
        for name, run in runs.items():
            ms[name].append(timer(run, x))
    faster = [c for c in ms if c != aten_id and (not baseline or all(t < b for t, b in zip(ms[c], ms[aten_id])))]
    kernel = min(faster, key=lambda c: sum(ms[c])) if faster else aten_id
    return GemmChoice(sig.kind, sig.shape, dtype, kernel, tokens,
                      {k: tuple(round(v, 4) for v in vs) for k, vs in ms.items()}, rejected=rejected)


def _random_weight(sig: Projection, generator: torch.Generator) -> torch.Tensor:
    n, k = sig.shape
    if sig.kind in (*INT8_KINDS, "int8_blocked", "int8_grouped"):
        top = sig.code_max
        return torch.randint(-top, top + 1, (n, k), generator=generator, dtype=torch.int8)
    if sig.kind == "int4":
        return torch.randint(0, 256, (n, k), generator=generator, dtype=torch.uint8)
    w = torch.randn(n, k, generator=generator) * 0.05
    return w.to(sig.dtype)


def _random_input(sig: Projection, tokens: int, generator: torch.Generator) -> list:
    k = sig.shape[1] * (2 if sig.kind == "int4" else 1)
    if sig.kind == "float":
        return [torch.randn(tokens, k, generator=generator).to(sig.dtype)]
    codes = torch.randint(-127, 128, (tokens, k), generator=generator, dtype=torch.int8)
    if sig.kind == "fp8":
        codes = (torch.randn(tokens, k, generator=generator) * 50).to(torch.float8_e4m3fn)
    blocks = k // ACT_BLOCK if sig.kind in BLOCKED_KINDS else 1  # a scale per block
    return [codes, torch.rand(tokens, blocks, generator=generator) * 0.01 + 1e-4]


def _runner(sig: Projection, candidate: GemmCandidate, weights: list[torch.Tensor], scale: torch.Tensor,
            bias: torch.Tensor | None) -> Callable:
    """A call of `candidate`'s GEMM on its inputs that reads the next weight copy each time, with the
    kernel's id as its `kernel` attribute (what a stand-in timer reads)."""
    turn = [0]

    def weight() -> torch.Tensor:
        turn[0] = (turn[0] + 1) % len(weights)
        return weights[turn[0]]

    run = candidate.runner(sig, weight, bias, scale)
    run.kernel = candidate.id
    return run


def _differs(sig: Projection, runs: dict[str, Callable], generator: torch.Generator) -> str | None:
    """Why the candidate's numbers are not the baseline's (both on the same weight copy), or None."""
    x = _random_input(sig, 7, generator)
    if sig.kind in (*INT8_KINDS, *BLOCKED_KINDS):  # the extreme codes, where a saturating kernel goes wrong
        x[0] = torch.where(torch.rand(x[0].shape, generator=generator) < 0.5, 127, -127).to(torch.int8)
    ref, got = (run(*x).float() for run in runs.values())
    tolerance = 1e-4 if sig.dtype.itemsize >= 4 or sig.kind != "float" else 2e-2
    err = ((got - ref).abs().max() / ref.abs().max().clamp(min=1e-6)).item()
    if sig.kind == "fp8" or sig.act_dtype != torch.float32:
        tolerance = max(tolerance, 1e-2)
    return None if err <= tolerance else f"differs from torch's GEMM (relative error {err:.2g} > {tolerance:g})"
