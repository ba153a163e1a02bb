"""Mixture-of-experts op: route each token to its top-k experts and sum their SiLU-gated MLPs,
weighted by the router. One op, so that a pass sees the MoE layer whole and a kernel can group tokens
by expert; the weights are arguments, so every MoE layer traces to the same graph.

The experts' weights are full precision, or quantized as `kiln.models.quantization`'s projections are
(int8 or fp8 codes with a scale per output channel, q8_0's scale per output channel and block of 32, int4's
codes with a scale and minimum per group): each expert's GEMM is then the op its projection would call."""

import torch
import torch.nn.functional as F

from kiln.kernels.activation import silu_and_mul_native
from kiln.kernels.quant import ACT_BLOCK

ops = torch.ops.kiln


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids), each [tokens, top_k]: the softmax over all experts (in fp32) at the top k,
    renormalized to sum to 1 if asked (Mixtral always, Qwen3-MoE with `norm_topk_prob`)."""
    weights, experts = torch.topk(torch.softmax(router_logits, dim=-1, dtype=torch.float32), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def expert_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                  low: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T for one expert's W, as its projection would run it (`QuantLinear`, `Int4Linear`): full precision
    (no scale); int4 codes (a minimum); int8 codes with activations in blocks of 32 on a CPU (q8_0's grouped
    scale always), else per token; fp8 codes with activations per token."""
    if scale is None:
        return F.linear(x, weight)
    if low is not None:
        q, s = ops.quant_int8_blocked(x, ACT_BLOCK)
        return ops.int4_block_mm(q, s, weight, scale, low, x.dtype)
    if weight.dtype == torch.int8 and (scale.dim() == 2 or x.device.type == "cpu" and x.shape[-1] % ACT_BLOCK == 0):
        q, s = ops.quant_int8_blocked(x, ACT_BLOCK)
        return ops.int8_block_mm(q, s, weight, scale, x.dtype)
    q, s = (ops.quant_int8 if weight.dtype == torch.int8 else ops.quant_fp8)(x)
    return ops.scaled_mm(q, weight, s, scale, x.dtype)


def fused_moe_native(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     top_k: int, renormalize: bool, w13_scale: torch.Tensor | None = None,
                     w2_scale: torch.Tensor | None = None, w13_min: torch.Tensor | None = None,
                     w2_min: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens grouped by expert: each chosen expert runs once on its tokens, and only the chosen
    experts' weights are read (a decode step of one token reads top_k of them)."""
    weights, experts = route(router_logits, top_k, renormalize)
    weights = weights.to(x.dtype).flatten()
    order = experts.flatten().argsort(stable=True)
    counts = torch.bincount(experts.flatten(), minlength=w13.shape[0]).tolist()
    out = torch.zeros_like(x)

    def part(t: torch.Tensor | None, expert: int) -> torch.Tensor | None:
        return None if t is None else t[expert]

    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        picks = order[start:start + count]  # (token, slot) pairs, flattened
        rows = picks // top_k
        h = expert_linear(x.index_select(0, rows), w13[expert], part(w13_scale, expert), part(w13_min, expert))
        y = expert_linear(silu_and_mul_native(h), w2[expert], part(w2_scale, expert), part(w2_min, expert))
        out.index_add_(0, rows, y * weights[picks].unsqueeze(1))
        start += count
    return out


@torch.library.custom_op("kiln::fused_moe", mutates_args=())
def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              renormalize: bool, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
              w13_min: torch.Tensor | None = None, w2_min: torch.Tensor | None = None) -> torch.Tensor:
    """x [tokens, hidden], router_logits [tokens, experts], w13 [experts, 2 * inter, hidden] (gate rows,
    then up rows), w2 [experts, hidden, inter] -> [tokens, hidden]. Quantized experts: w13 and w2 hold codes
    (int4: two a byte, so the last dimension halved), with their scales [experts, rows] (per output channel)
    or [experts, rows, groups], and int4's minimums like the scales."""
    return fused_moe_native(x, router_logits, w13, w2, top_k, renormalize, w13_scale, w2_scale, w13_min, w2_min)


@fused_moe.register_fake
def _(x, router_logits, w13, w2, top_k, renormalize, w13_scale=None, w2_scale=None, w13_min=None, w2_min=None):
    return torch.empty_like(x)
