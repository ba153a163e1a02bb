"""The mixture-of-experts MLP (Qwen3-MoE's, Mixtral's): a router and experts, run as one
`torch.ops.kiln.fused_moe` over weights that are graph inputs, so every MoE layer traces alike.

The experts' weights are two projections per layer, each expert's rows stacked in order (what the
loader fills expert by expert from the checkpoint's per-expert tensors): `gate_up_proj`
[experts * 2 * inter, hidden] (each expert's gate rows, then its up rows) and `down_proj`
[experts * hidden, inter]. As projections they quantize like the dense MLP's (`kiln.models.quantization`,
quantize-while-loading included): a scale or group is per row, so stacking experts changes none.
Under tensor parallelism each rank holds every expert's share of the intermediate dimension (`inter` is
the rank's), and the block's output is summed over ranks like the dense MLP's."""

import torch
from torch import nn

import kiln.kernels  # noqa: F401  (registers torch.ops.kiln)
from kiln.models.config import ModelConfig, MoeSpec

ops = torch.ops.kiln


class Experts(nn.Module):
    def __init__(self, moe: MoeSpec, hidden: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.num, self.inter, self.hidden = moe.num_experts, inter, hidden
        self.gate_up_proj = nn.Linear(hidden, self.num * 2 * inter, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inter, self.num * hidden, bias=False, dtype=dtype)

    def stacked(self, proj: nn.Module) -> tuple[torch.Tensor, ...]:
        """`proj`'s weight and, quantized, its scales and minimums (None where it has none), each viewed
        [experts, rows, ...]."""
        def per_expert(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.view(self.num, t.shape[0] // self.num, *t.shape[1:])

        return tuple(per_expert(getattr(proj, name, None)) for name in ("weight", "weight_scale", "weight_min"))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, inter: int, reduce: str | None, dtype: torch.dtype):
        super().__init__()
        moe = cfg.moe
        self.top_k, self.renormalize, self.reduce = moe.top_k, moe.renormalize, reduce
        self.gate = nn.Linear(cfg.hidden_size, moe.num_experts, bias=False, dtype=dtype)
        self.experts = Experts(moe, cfg.hidden_size, inter, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w13, w13_scale, w13_min = self.experts.stacked(self.experts.gate_up_proj)
        w2, w2_scale, w2_min = self.experts.stacked(self.experts.down_proj)
        out = ops.fused_moe(x, self.gate(x), w13, w2, self.top_k, self.renormalize, w13_scale, w2_scale, w13_min,
                            w2_min)
        return out if self.reduce is None else ops.all_reduce(out, self.reduce)


def expert_sources(cfg: ModelConfig, pname: str, inter: int) -> list[tuple[str, int, int]] | None:
    """The checkpoint tensors of experts parameter `pname` (a weight, or a scale a row), (name, row offset, rows)
    expert by expert, `inter` the experts' intermediate rows this rank holds; None if `pname` is not one."""
    prefix, _, rest = pname.rpartition(".experts.")
    kind, _, suffix = rest.partition(".")
    if cfg.moe is None or kind not in ("gate_up_proj", "down_proj"):
        return None
    (gate, up, down), hidden = cfg.moe.expert_names, cfg.hidden_size
    sources = []
    for e in range(cfg.moe.num_experts):
        name = f"{prefix}.experts.{e}.{{}}.{suffix}"
        if kind == "gate_up_proj":
            sources += [(name.format(gate), 2 * e * inter, inter), (name.format(up), (2 * e + 1) * inter, inter)]
        else:
            sources.append((name.format(down), e * hidden, hidden))
    return sources
