"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3; with `kiln.models.moe`'s MLP, Qwen3-MoE and
Mixtral) on kiln ops.

forward(input_ids, positions, kv_caches, attn_metadata) -> hidden_states is the compiled region;
the LM head (`compute_logits`) runs outside it. Every per-layer tensor (weights, KV cache) reaches
the ops as a tensor argument, so all decoder layers trace to the same graph. Under tensor
parallelism each rank builds its share (`RankLayout`); anything rank-specific is a tensor too, so
every rank traces the same graph.
"""

from collections.abc import Callable

import torch
from torch import nn

import kiln.kernels  # noqa: F401  (registers torch.ops.kiln)
from kiln.kernels import AttentionMetadata
from kiln.config import ParallelConfig
from kiln.kernels.rotary import rope_cos_sin_cache
from kiln.models.config import ModelConfig
from kiln.models.moe import SparseMoeBlock
from kiln.models.tensor_parallel import RankLayout

ops = torch.ops.kiln


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: RankLayout, group_name: str, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = layout.num_heads, layout.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * cfg.head_dim, self.num_kv_heads * cfg.head_dim
        self.reduce = group_name if layout.world_size > 1 else None
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, cfg.o_bias, dtype=dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype)
        self.qk_norm = cfg.qk_norm
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.sliding_window or 0

    def forward(self, positions, x, cos_sin_cache, kv_cache, meta: AttentionMetadata):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rotary_embedding(positions, q, k, cos_sin_cache, True)
        written = ops.kv_cache_write(k, v, kv_cache, meta.slot_mapping)
        o = ops.attention(
            q, kv_cache, written, meta.query_start_loc, meta.seq_lens, meta.block_tables,
            self.scale, self.sliding_window,
        )
        return _reduce(self.o_proj(o.view(-1, self.q_size)), self.reduce)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: RankLayout, group_name: str, dtype: torch.dtype):
        super().__init__()
        inter = layout.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * inter, cfg.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, cfg.mlp_bias, dtype=dtype)
        self.reduce = group_name if layout.world_size > 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _reduce(self.down_proj(ops.silu_and_mul(self.gate_up_proj(x))), self.reduce)


def _reduce(x: torch.Tensor, group_name: str | None) -> torch.Tensor:
    """The sum of the ranks' partial results of a row-parallel layer (None: one rank, nothing to sum)."""
    return x if group_name is None else ops.all_reduce(x, group_name)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: RankLayout, group_name: str, dtype: torch.dtype):
        super().__init__()
        self.self_attn = Attention(cfg, layout, group_name, dtype)
        self.ffn = cfg.moe.module if cfg.moe is not None else "mlp"  # the checkpoint's name for it
        reduce = group_name if layout.world_size > 1 else None
        self.add_module(self.ffn, SparseMoeBlock(cfg, layout.moe_intermediate_size, reduce, dtype) if cfg.moe else
                        MLP(cfg, layout, group_name, dtype))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions, x, residual, cos_sin_cache, kv_cache, meta):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm.add_forward(x, residual)
        x = self.self_attn(positions, x, cos_sin_cache, kv_cache, meta)
        x, residual = self.post_attention_layernorm.add_forward(x, residual)
        return getattr(self, self.ffn)(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, layout: RankLayout, group_name: str, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(layout.vocab_per_rank, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, layout, group_name, dtype) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class CausalLM(nn.Module):
    """The whole model; parameter names follow Hugging Face's except the merged qkv/gate_up."""

    # Hugging Face projection -> (kiln's merged parameter, index of its slice along dim 0)
    stacked_params = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 parallel: ParallelConfig = ParallelConfig()):
        super().__init__()
        self.config, self.dtype, self.parallel = cfg, dtype, parallel
        self.layout = layout = RankLayout.of(cfg, parallel)
        self.model = DecoderModel(cfg, layout, parallel.group_name, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, layout.vocab_per_rank, bias=False, dtype=dtype)
        self.register_buffer("cos_sin_cache", torch.empty(0, dtype=dtype), persistent=False)
        self.lm_head_kernel: Callable[[torch.Tensor], torch.Tensor] | None = None
        """What computes hidden @ lm_head_weight().T when set (`kiln.models.lm_head`); else a plain matmul."""
        self.kv_cache_dtype: torch.dtype | None = None
        """The KV cache's dtype where it is not the model's: torch.int8 (`kiln.kernels.kv_cache`). A key factor:
        the compiled cache write quantizes."""
        if layout.world_size > 1:  # a tensor, not a constant: every rank traces the same graph
            self.register_buffer("vocab_start", torch.empty((), dtype=torch.int64), persistent=False)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype its KV caches are allocated in."""
        return self.kv_cache_dtype or self.dtype

    def stacked_sizes(self, merged: str) -> list[int]:
        """Row counts (on this rank) of the slices that make up a merged parameter, in stacking order."""
        layout = self.layout
        if merged == "qkv_proj":
            return [layout.num_heads * layout.head_dim] + [layout.num_kv_heads * layout.head_dim] * 2
        return [layout.intermediate_size] * 2

    def init_buffers(self) -> None:
        """Build the rotary table (not a checkpoint tensor) on the model's device."""
        cfg = self.config
        device = self.model.embed_tokens.weight.device
        self.cos_sin_cache = rope_cos_sin_cache(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, self.dtype
        ).to(device)
        if self.layout.world_size > 1:
            self.vocab_start = torch.tensor(self.layout.vocab_start, device=device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; under tensor parallelism each rank looks up the ids in its vocabulary
        rows (zeros for the others) and the ranks' rows are summed."""
        if self.layout.world_size == 1:
            return self.model.embed_tokens(input_ids)
        rows = self.layout.vocab_per_rank
        local = input_ids - self.vocab_start
        inside = (local >= 0) & (local < rows)
        x = self.model.embed_tokens(local.clamp(0, rows - 1)) * inside.unsqueeze(-1).to(self.dtype)
        return ops.all_reduce(x, self.parallel.group_name)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x, residual = self.embed(input_ids), None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(positions, x, residual, self.cos_sin_cache, kv_cache, attn_metadata)
        x, _ = self.model.norm.add_forward(x, residual)
        return x

    def lm_head_weight(self) -> torch.Tensor:
        """This rank's rows of the output projection: the embedding's when they are tied."""
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor,
                       head: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Logits over the whole vocabulary, on every rank (each computes its rows, then all gather).
        `head` computes this rank's rows (default: `lm_head_kernel`, else a matmul on the weight)."""
        head = self.lm_head_kernel or head
        logits = (head(hidden) if head is not None else hidden @ self.lm_head_weight().t()).float()
        n = self.layout.world_size
        if n == 1:
            return logits
        gathered = ops.all_gather(logits, n, self.parallel.group_name)  # [ranks, tokens, rows]
        return gathered.permute(1, 0, 2).reshape(logits.shape[0], -1)[:, : self.layout.vocab_size]
