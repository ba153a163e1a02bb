"""Mixture-of-experts op: route each token to its top-k experts and sum their SiLU-gated MLPs,
weighted by the router. One op, so that a pass sees the MoE layer whole and a kernel can group tokens
by expert; the weights are arguments, so every MoE layer traces to the same graph."""

import torch
import torch.nn.functional as F

from kiln.kernels.activation import silu_and_mul_native


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, expert ids), each [tokens, top_k]: the softmax over all experts (in fp32) at the top k,
    renormalized to sum to 1 if asked (Mixtral always, Qwen3-MoE with `norm_topk_prob`)."""
    weights, experts = torch.topk(torch.softmax(router_logits, dim=-1, dtype=torch.float32), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def fused_moe_native(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     top_k: int, renormalize: bool) -> torch.Tensor:
    """Tokens grouped by expert: each chosen expert runs once on its tokens, and only the chosen
    experts' weights are read (a decode step of one token reads top_k of them)."""
    weights, experts = route(router_logits, top_k, renormalize)
    weights = weights.to(x.dtype).flatten()
    order = experts.flatten().argsort(stable=True)
    counts = torch.bincount(experts.flatten(), minlength=w13.shape[0]).tolist()
    out = torch.zeros_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        picks = order[start:start + count]  # (token, slot) pairs, flattened
        rows = picks // top_k
        y = F.linear(silu_and_mul_native(F.linear(x.index_select(0, rows), w13[expert])), w2[expert])
        out.index_add_(0, rows, y * weights[picks].unsqueeze(1))
        start += count
    return out


@torch.library.custom_op("kiln::fused_moe", mutates_args=())
def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              renormalize: bool) -> torch.Tensor:
    """x [tokens, hidden], router_logits [tokens, experts], w13 [experts, 2 * inter, hidden] (gate rows,
    then up rows), w2 [experts, hidden, inter] -> [tokens, hidden]."""
    return fused_moe_native(x, router_logits, w13, w2, top_k, renormalize)


@fused_moe.register_fake
def _(x, router_logits, w13, w2, top_k, renormalize):
    return torch.empty_like(x)
