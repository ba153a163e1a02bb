"""One rank's share of a model under tensor parallelism, and which slice of each checkpoint tensor it reads.

Attention heads, MLP columns and vocabulary rows are split evenly across ranks (Megatron's layout):
q/k/v and gate/up are column-parallel (each rank computes some output features), o_proj and down_proj
row-parallel (each rank sums over its features, then `kiln::all_reduce` adds the ranks' partial sums).
With fewer KV heads than ranks, each KV head is replicated on the ranks whose query heads use it.
The vocabulary is padded to a multiple of the rank count; padding rows are zero. A mixture-of-experts
layer splits every expert the same way along its intermediate dimension (vLLM's tensor parallelism of
experts, no expert parallelism): each rank holds a share of each expert, the router is replicated.
"""

from dataclasses import dataclass

from kiln.config import ParallelConfig
from kiln.errors import KilnError
from kiln.models.config import ModelConfig

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


@dataclass(frozen=True)
class Shard:
    """The slice of a checkpoint tensor one rank reads: `size` entries from `start` along `dim`.
    A parameter may hold more (vocabulary padding: zero-filled); size 0 means zeros only (the bias
    of a row-parallel layer, which rank 0 alone adds)."""

    dim: int
    start: int
    size: int


@dataclass(frozen=True)
class RankLayout:
    """Per-rank sizes of a model split `world_size` ways, for `rank`."""

    rank: int
    world_size: int
    num_heads: int
    num_kv_heads: int
    kv_head_start: int
    intermediate_size: int
    vocab_per_rank: int
    vocab_size: int
    """The unpadded vocabulary: logits beyond it (padding) are dropped."""
    head_dim: int
    moe_intermediate_size: int = 0
    """Each expert's intermediate rows this rank holds (0: a dense model)."""
    expert_names: tuple[str, ...] = ()
    """The checkpoint's names of an expert's gate, up and down projections (`MoeSpec.expert_names`)."""

    @classmethod
    def of(cls, cfg: ModelConfig, parallel: ParallelConfig = ParallelConfig()) -> "RankLayout":
        """The layout of `cfg` on `parallel.rank`; KilnError when the model does not split evenly."""
        n, r = parallel.world_size, parallel.rank
        moe = cfg.moe
        inter = ("the experts' intermediate size", moe.intermediate_size) if moe else \
            ("intermediate_size", cfg.intermediate_size)
        problems = [f"{name} {value} is not divisible by the tensor parallel size {n}"
                    for name, value in (("num_attention_heads", cfg.num_heads), inter) if value % n]
        if cfg.num_kv_heads % n and n % cfg.num_kv_heads:
            problems.append(f"num_key_value_heads {cfg.num_kv_heads} neither divides nor is divisible by the "
                            f"tensor parallel size {n}")
        if problems:
            raise KilnError(f"cannot split {cfg.architecture} across {n} ranks: {'; '.join(problems)}: "
                            "choose a tensor parallel size that divides them")
        kv_heads = max(1, cfg.num_kv_heads // n)
        kv_start = r * kv_heads if cfg.num_kv_heads >= n else r * cfg.num_kv_heads // n
        return cls(rank=r, world_size=n, num_heads=cfg.num_heads // n, num_kv_heads=kv_heads,
                   kv_head_start=kv_start, intermediate_size=cfg.intermediate_size // n,
                   vocab_per_rank=-(-cfg.vocab_size // n), vocab_size=cfg.vocab_size, head_dim=cfg.head_dim,
                   moe_intermediate_size=moe.intermediate_size // n if moe else 0,
                   expert_names=moe.expert_names if moe else ())

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    def shard(self, name: str) -> Shard | None:
        """The slice of checkpoint tensor `name` this rank holds; None: all of it (replicated).
        A quantized projection's per-output-channel `weight_scale` follows its rows; a row-parallel
        layer keeps all its output channels, so all their scales; static `input_scale`s are per tensor."""
        if self.world_size == 1:
            return None
        if ".experts." in name:
            return self._expert_shard(name)
        proj = next((p for p in COLUMN_PARALLEL + ROW_PARALLEL if f".{p}." in name), None)
        rows = name.endswith((".weight", ".bias", ".weight_scale"))
        if proj in COLUMN_PARALLEL and not rows or proj in ROW_PARALLEL and not name.endswith((".weight", ".bias")):
            return None
        d = self.head_dim
        if proj in ("q_proj",):
            return Shard(0, self.rank * self.num_heads * d, self.num_heads * d)
        if proj in ("k_proj", "v_proj"):
            return Shard(0, self.kv_head_start * d, self.num_kv_heads * d)
        if proj in ("gate_proj", "up_proj"):
            return Shard(0, self.rank * self.intermediate_size, self.intermediate_size)
        if proj in ROW_PARALLEL:
            if name.endswith(".bias"):
                return None if self.rank == 0 else Shard(0, 0, 0)
            features = self.num_heads * d if proj == "o_proj" else self.intermediate_size
            return Shard(1, self.rank * features, features)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return Shard(0, self.vocab_start, max(0, min(self.vocab_per_rank, self.vocab_size - self.vocab_start)))
        return None

    def _expert_shard(self, name: str) -> Shard | None:
        """An expert's tensor: gate and up split by rows (their scales too), down by columns."""
        gate, up, down = self.expert_names
        proj = name.rpartition(".experts.")[2].split(".")[1]
        size = self.moe_intermediate_size
        if proj in (gate, up) and name.endswith((".weight", ".weight_scale")):
            return Shard(0, self.rank * size, size)
        if proj == down and name.endswith(".weight"):
            return Shard(1, self.rank * size, size)
        return None
