"""Builds each step's flattened batch: running sequences first, then new ones while the token
budget, the sequence cap and the KV blocks allow. Long prompts are prefilled in chunks; when blocks
run out, the most recently admitted sequence is preempted and later recomputed. With prefix
caching, a new sequence starts after the longest prefix of full blocks already in the cache."""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from kiln.config import EngineConfig
from kiln.runtime.kv_cache import BlockAllocator, block_hashes
from kiln.runtime.penalties import Adjustment
from kiln.runtime.sampler import SamplingParams
from kiln.runtime.stop_strings import StopStrings
from kiln.runtime.structured_output import GrammarMatcher
from kiln.runtime.tokenizer import IncrementalDetokenizer


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One request: its tokens, how many of them the KV cache holds, and its blocks."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator | None = None
    token_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=lambda: [None])
    """Each prompt token's logprob given those before it, filled as the prompt is prefilled (the first
    token has none)."""
    prompt_top_logprobs: list[dict[int, float] | None] = field(default_factory=lambda: [None])
    prompt_ranks: list[int | None] = field(default_factory=lambda: [None])
    pooled: torch.Tensor | None = None
    """An embedding request's pooled hidden states so far (their sum for "mean", the last row for "last")."""
    finish_reason: str | None = None
    detokenizer: IncrementalDetokenizer | None = None
    """The request's IncrementalDetokenizer (None without a tokenizer)."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Content hashes of the full blocks among `block_ids` (prefix caching)."""
    matcher: GrammarMatcher | None = None
    """Where the output stands in its structured-output grammar, if it has one."""
    adjustment: Adjustment | None = None
    """Its biases and bans as tensors, prepared when it was added (None: it adjusts no logits)."""
    stops: StopStrings | None = None
    """Its stop strings, prepared for the search each new token makes (None: it has none)."""
    stop_ids: frozenset[int] = frozenset()
    """Its `stop_token_ids`, as a set."""

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_pending(self) -> int:
        """Tokens whose K/V are not yet in the cache."""
        return len(self.token_ids) - self.num_computed


@dataclass
class ScheduledBatch:
    """The sequences of one step, each with the number of its tokens to run."""

    seqs: list[Sequence]
    num_tokens: list[int]


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int):
        self.config = config
        self.allocator = BlockAllocator(num_blocks, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.prefix_cache_queries = self.prefix_cache_hits = 0
        """Tokens of admitted sequences looked up in the prefix cache, and those found there (as vLLM
        counts them: a sequence's every token, once per admission; only with prefix caching)."""
        self.on_running: Callable[[Sequence], None] | None = None
        """Called as a sequence moves from waiting to running (again after a preemption): the
        server's queue-time metric."""

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _reserve(self, seq: Sequence, n: int) -> bool:
        """Make sure `seq` has blocks for its next `n` tokens."""
        need = -(-(seq.num_computed + n) // self.config.block_size) - len(seq.block_ids)
        if need > self.allocator.num_free:
            return False
        seq.block_ids += self.allocator.allocate(max(need, 0))
        return True

    def _reuse_prefix(self, seq: Sequence) -> None:
        """Start a new (or preempted) sequence after its cached prefix; one token is always left to
        compute, since its logits are needed."""
        bs = self.config.block_size
        hashes = block_hashes(seq.token_ids[: (len(seq.token_ids) - 1) // bs * bs], bs)
        seq.block_ids = self.allocator.lookup(hashes)
        seq.block_hashes = hashes[: len(seq.block_ids)]
        seq.num_computed = len(seq.block_ids) * bs

    def _release(self, seq: Sequence) -> None:
        self.allocator.free(seq.block_ids)
        seq.block_ids, seq.block_hashes, seq.num_computed = [], [], 0

    def computed(self, seq: Sequence, n: int) -> None:
        """`n` more of `seq`'s tokens are in the KV cache; blocks that filled up become shareable."""
        seq.num_computed += n
        if not self.allocator.prefix_caching:
            return
        done = len(seq.block_hashes)
        full = seq.num_computed // self.config.block_size
        if full > done:
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            new = block_hashes(seq.token_ids[: full * self.config.block_size], self.config.block_size, done, parent)
            for block, h in zip(seq.block_ids[done:], new):
                self.allocator.register(block, h)
            seq.block_hashes += new

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        batch = ScheduledBatch([], [])
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_pending, budget)
            if not self._reserve(seq, n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                continue  # retry `seq` (unless it was the victim, then the loop ends)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not preempted:
            seq = self.waiting[0]
            cached = (self.allocator.prefix_caching and seq.params.prompt_logprobs is None
                      and seq.params.pooling != "mean")  # those need every position
            if cached:
                self._reuse_prefix(seq)
            n = min(seq.num_pending, budget)
            if not self._reserve(seq, n):
                self._release(seq)
                break
            self.waiting.popleft()
            if cached:  # counted on admission, not on each try that found no room
                self.prefix_cache_queries += len(seq.token_ids)
                self.prefix_cache_hits += seq.num_computed
            if self.on_running is not None:
                self.on_running(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
        return batch

    def abort(self, request_id: str) -> Sequence | None:
        """Remove the request, waiting or running, and free its blocks."""
        for queue in (self.waiting, self.running):
            seq = next((s for s in queue if s.request_id == request_id), None)
            if seq is not None:
                queue.remove(seq)
                self._release(seq)
                seq.status, seq.finish_reason = Status.FINISHED, "abort"
                return seq
        return None

    @property
    def kv_usage(self) -> float:
        """Fraction of KV blocks in use."""
        return 1 - self.allocator.num_free / self.allocator.num_blocks

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = Status.FINISHED, reason
        self.running.remove(seq)
        self._release(seq)
