"""ModelConfig: the one normalized view of a Hugging Face config.json that kiln's models read."""

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kiln.config import DTYPES
from kiln.errors import KilnError
from kiln.models.compressed_tensors import (
    CheckpointQuantization,
    parse_quantization_config,
)
from kiln.weights.checkpoint import checkpoint_files
from kiln.weights.safetensors_file import SafetensorsFile

logger = logging.getLogger(__name__)


@dataclass
class ArchSpec:
    """What distinguishes one supported `architectures` entry from plain Llama."""

    qkv_bias: bool | None = None  # None: read `attention_bias` from config.json
    o_bias: bool | None = None  # likewise, for the output projection
    qk_norm: bool = False
    uses_sliding_window_flag: bool = False  # Qwen: `sliding_window` counts only if `use_sliding_window`
    moe: str | None = None  # a mixture-of-experts family: "qwen3" or "mixtral" (`MoeSpec.of`)


ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(),
    "MistralForCausalLM": ArchSpec(qkv_bias=False, o_bias=False),
    "Qwen2ForCausalLM": ArchSpec(qkv_bias=True, o_bias=False, uses_sliding_window_flag=True),
    "Qwen3ForCausalLM": ArchSpec(qk_norm=True, uses_sliding_window_flag=True),
    "Qwen3MoeForCausalLM": ArchSpec(qk_norm=True, uses_sliding_window_flag=True, moe="qwen3"),
    "MixtralForCausalLM": ArchSpec(qkv_bias=False, o_bias=False, moe="mixtral"),
}


@dataclass(frozen=True)
class MoeSpec:
    """A mixture-of-experts MLP in every layer: each token's `top_k` of `num_experts` SiLU-gated experts,
    weighted by the router's softmax at them (renormalized to sum to 1 if `renormalize`)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    """Each expert's."""
    renormalize: bool
    module: str
    """The checkpoint's name of a layer's MoE block: "mlp" (Qwen3-MoE) or "block_sparse_moe" (Mixtral)."""
    expert_names: tuple[str, str, str]
    """The checkpoint's names of each expert's gate, up and down projections."""

    @classmethod
    def of(cls, family: str, hf: dict) -> "MoeSpec":
        experts = hf.get("num_experts") or hf.get("num_local_experts")
        if not experts or not hf.get("num_experts_per_tok"):
            raise KilnError("a mixture-of-experts config.json needs num_experts (or num_local_experts) and "
                            "num_experts_per_tok")
        if family == "mixtral":
            return cls(experts, hf["num_experts_per_tok"], hf["intermediate_size"], True, "block_sparse_moe",
                       ("w1", "w3", "w2"))
        if hf.get("mlp_only_layers") or hf.get("decoder_sparse_step", 1) != 1:
            raise KilnError("Qwen3-MoE with dense layers among the sparse ones (mlp_only_layers, decoder_sparse_step "
                            "other than 1) is not supported: kiln runs models whose every layer is MoE")
        return cls(experts, hf["num_experts_per_tok"], hf.get("moe_intermediate_size") or hf["intermediate_size"],
                   bool(hf.get("norm_topk_prob", False)), "mlp", ("gate_proj", "up_proj", "down_proj"))


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    quantization: CheckpointQuantization | None = None  # a pre-quantized (compressed-tensors) checkpoint
    moe: MoeSpec | None = None
    """Mixture-of-experts layers (their MLP is experts and a router); None: dense."""
    dtype: str | None = None
    """The checkpoint's dtype as config.json states it (`torch_dtype`, transformers 5's `dtype`)."""

    def projection_shape(self, proj: str) -> tuple[int, int]:
        """[output, input] features of a decoder projection (`q_proj`, ..., `down_proj`), whole: not
        split over ranks."""
        attention, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        shapes = {"q_proj": (attention, self.hidden_size), "k_proj": (kv, self.hidden_size),
                  "v_proj": (kv, self.hidden_size), "o_proj": (self.hidden_size, attention),
                  "gate_proj": (self.intermediate_size, self.hidden_size),
                  "up_proj": (self.intermediate_size, self.hidden_size),
                  "down_proj": (self.hidden_size, self.intermediate_size)}
        return shapes[proj]

    def resolve_dtype(self, asked: str) -> str:
        """The dtype to run in: `asked`, or for "auto" the checkpoint's (float32 when config.json
        names none or one kiln does not run)."""
        if asked != "auto":
            if asked not in DTYPES:
                raise KilnError(f"unknown dtype {asked!r}; choose auto or one of {', '.join(DTYPES)}")
            return asked
        return self.dtype if self.dtype in DTYPES else "float32"

    @classmethod
    def from_hf(cls, hf: dict) -> "ModelConfig":
        """Read a config.json dict written by transformers 4.x (`rope_theta`, `rope_scaling`) or 5.x
        (`rope_parameters`)."""
        archs = hf.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise KilnError(
                f"unsupported architecture {', '.join(archs) or '(none given)'} in config.json; "
                f"kiln supports {', '.join(ARCHITECTURES)}"
            )
        spec = ARCHITECTURES[arch]
        if hf.get("hidden_act", "silu") != "silu":
            raise KilnError(f"hidden_act {hf['hidden_act']!r} is not supported: kiln's MLP is SiLU-gated")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = float(rope.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        window = hf.get("sliding_window")
        if spec.uses_sliding_window_flag and not hf.get("use_sliding_window", False):
            window = None
        layer_types = set(hf.get("layer_types") or [])
        if window is not None and layer_types - {"sliding_attention"}:
            raise KilnError(
                "per-layer sliding windows (mixed `layer_types`) are not supported; "
                "set use_sliding_window=false or use a uniform window"
            )
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        bias = hf.get("attention_bias", False)
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            rope_scaling=rope if rope_type != "default" else None,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            qkv_bias=bias if spec.qkv_bias is None else spec.qkv_bias,
            o_bias=bias if spec.o_bias is None else spec.o_bias,
            mlp_bias=hf.get("mlp_bias", False),
            qk_norm=spec.qk_norm,
            sliding_window=window,
            eos_token_ids=tuple(eos if isinstance(eos, list) else [eos] if eos is not None else []),
            quantization=parse_quantization_config(hf.get("quantization_config")),
            moe=MoeSpec.of(spec.moe, hf) if spec.moe else None,
            dtype=_dtype_name(hf.get("dtype") or hf.get("torch_dtype")),
        )

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise KilnError(f"{model_dir} has no config.json: pass a Hugging Face model directory")
        try:
            hf = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise KilnError(f"{path} is not valid JSON ({e})") from None
        try:
            config = cls.from_hf(hf)
        except KeyError as e:
            raise KilnError(f"{path} lacks required field {e.args[0]!r}") from None
        return untie_stored_lm_head(config, Path(model_dir))


def _dtype_name(value) -> str | None:
    """config.json's dtype ("bfloat16", or "torch.bfloat16" as some writers put it)."""
    return value.removeprefix("torch.") if isinstance(value, str) else None


def untie_stored_lm_head(config: ModelConfig, model_dir: Path) -> ModelConfig:
    """`config`, untied when it says `tie_word_embeddings` but the checkpoint stores an `lm_head.weight`
    that differs from the embedding: that weight is the output projection, as transformers loads such
    a checkpoint (a copy equal to the embedding stays tied, one matrix in memory)."""
    if not config.tie_word_embeddings or not any(model_dir.glob("*.safetensors")):
        return config
    found: dict[str, Path] = {}
    for path in checkpoint_files(model_dir):
        with SafetensorsFile(path) as f:
            found.update({name: path for name in ("lm_head.weight", "model.embed_tokens.weight") if name in f})
    if len(found) < 2:
        return config
    with SafetensorsFile(found["lm_head.weight"]) as head, SafetensorsFile(found["model.embed_tokens.weight"]) as emb:
        same = torch.equal(head.tensor("lm_head.weight"), emb.tensor("model.embed_tokens.weight"))
    if same:
        return config
    logger.warning("%s: config.json says tie_word_embeddings, but the checkpoint stores an lm_head.weight of its "
                   "own: kiln uses it, as transformers does (set tie_word_embeddings=false to silence this)", model_dir)
    return dataclasses.replace(config, tie_word_embeddings=False)
