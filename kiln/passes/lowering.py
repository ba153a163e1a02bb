"""After fusion: each remaining kiln op that has no kernel of its own on this platform becomes its
native torch form, which Inductor then fuses with its neighbours into one generated loop.

Kept as ops: the attention (the split point), the cache writes on CUDA (a Triton kernel each), the
collectives and `scaled_mm` (a library matmul either way). On CUDA each norm and activation op is
first measured against its Triton kernel (`kernel_choice`): where the kernel is faster it is kept,
as a `kiln_triton` op AOTInductor compiles in, and not lowered. On CPU each projection is first
measured against a oneDNN kernel on a weight packed at load (`gemm_choice`), and retargeted to it
where that is faster.
"""

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.kernels.activation import silu_and_mul_native
from kiln.kernels.fused_quant import (fused_add_rms_norm_quant_native, rms_norm_quant_native,
                                     silu_and_mul_quant_native)
from kiln.kernels.kv_cache import kv_cache_write_scatter
from kiln.kernels.norm import fused_add_rms_norm_native, rms_norm_native
from kiln.kernels.quant import quant_int8_blocked_native, quant_native
from kiln.kernels.rotary import rotary_embedding_native
from kiln.passes.base import Pattern, PatternPass, SizeRange
from kiln.passes.gemm_choice import GemmChoice, GemmChooser
from kiln.passes.kernel_choice import KernelChoice, choose_kernels, measured_tokens
from kiln.passes.fusion.quant_kinds import QUANT_KINDS, QuantKind

ops = torch.ops.kiln
EPS = {"eps": 1e-6}


def _norms() -> list[Pattern]:
    x, res, w = torch.empty(4, 16), torch.empty(4, 16), torch.empty(16)
    return [
        Pattern(lambda x, weight, eps: ops.rms_norm(x, weight, eps), rms_norm_native, [x, w], EPS),
        Pattern(lambda x, residual, weight, eps: ops.fused_add_rms_norm(x, residual, weight, eps),
                fused_add_rms_norm_native, [x, res, w], EPS),
        Pattern(lambda x, residual, weight, eps: ops.fused_add_rms_norm(x, residual, weight, eps)[0],  # final norm
                lambda x, residual, weight, eps: fused_add_rms_norm_native(x, residual, weight, eps)[0],
                [x, res, w], EPS),
        Pattern(lambda x: ops.silu_and_mul(x), silu_and_mul_native, [torch.empty(4, 32)]),
    ]


def _inline_native(graph: fx.Graph, node: fx.Node, native) -> None:
    """Replace `node`, a kiln op call, by `native`'s aten ops traced on its inputs. For ops the
    pattern matcher cannot replace: it refuses a match beside a mutation, and the rotary's rotated
    key feeds the KV-cache write."""
    vals = fx.node.map_arg(node.args, lambda n: n.meta["val"])
    tensors = [i for i, a in enumerate(node.args) if isinstance(a, fx.Node)]

    def traced(*inputs):
        args = list(vals)
        for i, value in zip(tensors, inputs):
            args[i] = value
        return native(*args)

    with detect_fake_mode([vals[i] for i in tensors]):
        gm = make_fx(traced, tracing_mode="real")(*[vals[i] for i in tensors])
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    with graph.inserting_before(node):
        outputs = graph.graph_copy(gm.graph, {p: node.args[i] for p, i in zip(placeholders, tensors)})
    if not isinstance(node.meta["val"], (tuple, list)):
        node.replace_all_uses_with(outputs)
    for user in list(node.users):  # getitem(node, i) -> the copied graph's output i
        user.replace_all_uses_with(outputs[user.args[1]])
        graph.erase_node(user)
    graph.erase_node(node)


def _lower_rotary(graph: fx.Graph) -> int:
    """Each `kiln::rotary_embedding` => its native form, for Inductor to fuse into the QKV epilogue."""
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is ops.rotary_embedding.default]
    for node in nodes:
        _inline_native(graph, node, rotary_embedding_native)
    return len(nodes)


def _lower_cache_writes(graph: fx.Graph) -> int:
    """Each `kiln::kv_cache_write` into a CPU cache => its scatter form, which Inductor writes into the
    piece's own code (the K and V straight from the rotary's loop) instead of calling the op."""
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is ops.kv_cache_write.default
             and n.args[2].meta["val"].device.type == "cpu"]
    for node in nodes:
        _inline_native(graph, node, kv_cache_write_scatter)
    return len(nodes)


def _lower_blocked_quant(graph: fx.Graph) -> int:
    """Each `kiln::quant_int8_blocked` (int4's activations) => its native form, which Inductor fuses into the
    loop that makes its input (the RMSNorm or SiLU*Mul before it)."""
    nodes = [n for n in graph.nodes if n.op == "call_function" and n.target is ops.quant_int8_blocked.default]
    for node in nodes:
        _inline_native(graph, node, quant_int8_blocked_native)
    return len(nodes)


def _quantized(kind: QuantKind) -> list[Pattern]:
    """The plain quant op and the three fused ones, for one quantization kind."""
    x, res, w, gate_up, s = torch.empty(4, 16), torch.empty(4, 16), torch.empty(16), torch.empty(4, 32), torch.empty(1)
    d = kind.dtype
    if kind.static:
        return [
            Pattern(lambda x, scale: kind.op(x, scale), lambda x, scale: quant_native(x, scale, d), [x, s]),
            Pattern(lambda x, weight, scale, eps: ops.rms_norm_quant(x, weight, eps, d, scale),
                    lambda x, weight, scale, eps: rms_norm_quant_native(x, weight, eps, d, scale),
                    [x, w, s], EPS),
            Pattern(lambda x, residual, weight, scale, eps: ops.fused_add_rms_norm_quant(x, residual, weight, eps, d,
                                                                                         scale),
                    lambda x, residual, weight, scale, eps: fused_add_rms_norm_quant_native(x, residual, weight, eps,
                                                                                            d, scale),
                    [x, res, w, s], EPS),
            Pattern(lambda x, scale: ops.silu_and_mul_quant(x, d, scale),
                    lambda x, scale: silu_and_mul_quant_native(x, d, scale), [gate_up, s]),
        ]
    return [
        Pattern(lambda x: kind.op(x, None), lambda x: quant_native(x, None, d), [x]),
        Pattern(lambda x, weight, eps: ops.rms_norm_quant(x, weight, eps, d, None),
                lambda x, weight, eps: rms_norm_quant_native(x, weight, eps, d), [x, w], EPS),
        Pattern(lambda x, residual, weight, eps: ops.fused_add_rms_norm_quant(x, residual, weight, eps, d, None),
                lambda x, residual, weight, eps: fused_add_rms_norm_quant_native(x, residual, weight, eps, d),
                [x, res, w], EPS),
        Pattern(lambda x: ops.silu_and_mul_quant(x, d, None),
                lambda x: silu_and_mul_quant_native(x, d), [gate_up]),
    ]


def _gather_then_norm(graph: fx.Graph) -> None:
    """all_reduce_fused_add_rms_norm[_quant] => all_gather, a sum over ranks and the plain fused norm
    (which the patterns then lower): Inductor sums the gathered partials, adds, normalizes (and
    quantizes) in one loop."""
    norms = {ops.all_reduce_fused_add_rms_norm.default: ops.fused_add_rms_norm.default,
             ops.all_reduce_fused_add_rms_norm_quant.default: ops.fused_add_rms_norm_quant.default}
    for node in list(graph.nodes):
        if node.target not in norms:
            continue
        x, *norm_args, world_size, group_name = node.args
        with graph.inserting_before(node):
            gathered = graph.call_function(ops.all_gather.default, (x, world_size, group_name))
            summed = graph.call_function(torch.ops.aten.sum.dim_IntList, (gathered, [0]))
            norm = graph.call_function(norms[node.target], (summed, *norm_args))
        gathered.meta["val"] = x.meta["val"].new_empty((world_size, *x.meta["val"].shape))
        summed.meta["val"] = gathered.meta["val"].sum(0)
        norm.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(norm)
        graph.erase_node(node)


class Lowering(PatternPass):
    """kiln ops with a native torch form => that form, for Inductor to fuse, except where a
    measured Triton kernel wins (CUDA). `size_range` (set by the pass manager) is where the choice
    is measured; `choices` holds the last run's decisions."""

    name = "lowering"

    def __init__(self, choose: bool = True, gemms: GemmChooser | None = None):
        self.choose, self.gemms = choose, gemms
        self.size_range: SizeRange = (1, 1)
        self.choices: list[KernelChoice] = []
        self.gemm_choices: list[GemmChoice] = []
        self.weight_formats: dict[str, str] = {}
        """Packed weight inputs of the last graph: placeholder target -> format (`packed_linear`)."""

    def config(self) -> dict:
        return {"choose": self.choose, "gemm_choice": self.gemms is not None}

    def patterns(self) -> list[Pattern]:
        return [*_norms(), *(p for kind in QUANT_KINDS for p in _quantized(kind))]

    def __call__(self, graph: fx.Graph) -> int:
        _gather_then_norm(graph)  # counted below, as the norm it exposes
        self.gemm_choices, self.weight_formats = ([], {}) if self.gemms is None else self.gemms(graph, self.size_range)
        self.choices = choose_kernels(graph, measured_tokens(self.size_range)) if self.choose else []
        return _lower_rotary(graph) + _lower_cache_writes(graph) + _lower_blocked_quant(graph) + super().__call__(graph)
