"""The mixture-of-experts MLP (Qwen3-MoE's, Mixtral's): a router and experts, run as one
`torch.ops.kiln.fused_moe` over weights that are graph inputs, so every MoE layer traces alike.

The experts' weights are two parameters per layer, each expert's rows stacked in order (what the
loader fills expert by expert from the checkpoint's per-expert tensors): `gate_up_proj`
[experts * 2 * inter, hidden] (each expert's gate rows, then its up rows) and `down_proj`
[experts * hidden, inter]."""

import torch
from torch import nn

import kiln.kernels  # noqa: F401  (registers torch.ops.kiln)
from kiln.models.config import ModelConfig, MoeSpec

ops = torch.ops.kiln


class Experts(nn.Module):
    def __init__(self, moe: MoeSpec, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.num, self.inter, self.hidden = moe.num_experts, moe.intermediate_size, hidden
        self.gate_up_proj = nn.Parameter(torch.empty(self.num * 2 * self.inter, hidden, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(self.num * hidden, self.inter, dtype=dtype))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        moe = cfg.moe
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False, dtype=dtype)
        self.experts = Experts(moe, cfg.hidden_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.experts
        return ops.fused_moe(x, self.gate(x), e.gate_up_proj.view(e.num, 2 * e.inter, e.hidden),
                             e.down_proj.view(e.num, e.hidden, e.inter), self.top_k, self.renormalize)


def expert_sources(cfg: ModelConfig, pname: str) -> list[tuple[str, int, int]] | None:
    """The checkpoint tensors of experts parameter `pname`, (name, row offset, rows) expert by expert; None
    if `pname` is not one."""
    prefix, _, kind = pname.rpartition(".experts.")
    if cfg.moe is None or kind not in ("gate_up_proj", "down_proj"):
        return None
    (gate, up, down), inter, hidden = cfg.moe.expert_names, cfg.moe.intermediate_size, cfg.hidden_size
    sources = []
    for e in range(cfg.moe.num_experts):
        name = f"{prefix}.experts.{e}.{{}}.weight"
        if kind == "gate_up_proj":
            sources += [(name.format(gate), 2 * e * inter, inter), (name.format(up), (2 * e + 1) * inter, inter)]
        else:
            sources.append((name.format(down), e * hidden, hidden))
    return sources
