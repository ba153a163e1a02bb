"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) on kiln ops.

forward(input_ids, positions, kv_caches, attn_metadata) -> hidden_states is the compiled region;
the LM head (`compute_logits`) runs outside it. Every per-layer tensor (weights, KV cache) reaches
the ops as a tensor argument, so all decoder layers trace to the same graph.
"""

import torch
from torch import nn

import kiln.kernels  # noqa: F401  (registers torch.ops.kiln)
from kiln.kernels import AttentionMetadata
from kiln.kernels.rotary import rope_cos_sin_cache
from kiln.models.config import ModelConfig

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
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
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
        return self.o_proj(o.view(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, cfg.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, cfg.mlp_bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.self_attn = Attention(cfg, dtype)
        self.mlp = MLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, positions, x, residual, cos_sin_cache, kv_cache, meta):
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm.add_forward(x, residual)
        x = self.self_attn(positions, x, cos_sin_cache, kv_cache, meta)
        x, residual = self.post_attention_layernorm.add_forward(x, residual)
        return self.mlp(x), residual


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
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

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config, self.dtype = cfg, dtype
        self.model = DecoderModel(cfg, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        self.register_buffer("cos_sin_cache", torch.empty(0, dtype=dtype), persistent=False)

    def stacked_sizes(self, merged: str) -> list[int]:
        """Row counts of the slices that make up a merged parameter, in stacking order."""
        cfg = self.config
        if merged == "qkv_proj":
            return [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
        return [cfg.intermediate_size] * 2

    def init_buffers(self) -> None:
        """Build the rotary table (not a checkpoint tensor) on the model's device."""
        cfg = self.config
        device = self.model.embed_tokens.weight.device
        self.cos_sin_cache = rope_cos_sin_cache(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, self.dtype
        ).to(device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        x, residual = self.model.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.model.layers, kv_caches):
            x, residual = layer(positions, x, residual, self.cos_sin_cache, kv_cache, attn_metadata)
        x, _ = self.model.norm.add_forward(x, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return (hidden @ weight.t()).float()
