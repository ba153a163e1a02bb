"""Turns a scheduled batch into graph inputs, calls the forward, and returns logits for the
sequences that sample this step."""

import itertools
from collections.abc import Callable, Sequence

import torch

from kiln.kernels import AttentionMetadata
from kiln.runtime.scheduler import ScheduledBatch

ForwardFn = Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor], AttentionMetadata], torch.Tensor]


class ModelRunner:
    """Owns the KV cache tensors. `forward` is the eager model or, later, a loaded compiled program."""

    def __init__(
        self,
        forward: ForwardFn,
        compute_logits: Callable[[torch.Tensor], torch.Tensor],
        kv_caches: list[torch.Tensor],
        block_size: int,
        device: torch.device,
        greedy_tokens: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
    ):
        self.forward, self.compute_logits = forward, compute_logits
        self.kv_caches, self.block_size, self.device = kv_caches, block_size, device
        self.greedy_tokens = greedy_tokens
        """hidden -> each row's argmax token without the logits, or None when it cannot tell (a packed
        LM head's `GreedyScreen`)."""

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        bs = self.block_size
        for seq, n in zip(batch.seqs, batch.num_tokens):
            first = seq.num_computed
            ids += seq.token_ids[first : first + n]
            pos = range(first, first + n)
            positions += pos
            slots += [seq.block_ids[p // bs] * bs + p % bs for p in pos]
            starts.append(starts[-1] + n)
            seq_lens.append(first + n)
        width = max(len(s.block_ids) for s in batch.seqs)
        tables = [s.block_ids + [0] * (width - len(s.block_ids)) for s in batch.seqs]

        def t(x, dtype):
            return torch.tensor(x, dtype=dtype, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=t(slots, torch.int64),
            query_start_loc=t(starts, torch.int32),
            seq_lens=t(seq_lens, torch.int32),
            block_tables=t(tables, torch.int32),
        )
        return t(ids, torch.int64), t(positions, torch.int64), meta

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, sample_rows: list[int], every_token_rows: Sequence[int] = (),
                greedy: bool = False, hidden_rows: Sequence[int] = ()
                ) -> tuple[torch.Tensor | None, list[torch.Tensor], torch.Tensor | None, list[torch.Tensor]]:
        """Run the batch; return fp32 logits [len(sample_rows), vocab] at the last token of each
        listed sequence (by index into `batch.seqs`), for each of `every_token_rows` the logits at
        every token it ran (for prompt logprobs), None, and for each of `hidden_rows` the final hidden
        states of every token it ran (for embeddings). With `greedy` (each listed sequence takes the
        argmax of its raw logits) the first and third are swapped where `greedy_tokens` can tell: None,
        then the argmax tokens."""
        input_ids, positions, meta = self.prepare(batch)
        hidden = self.forward(input_ids, positions, self.kv_caches, meta)
        last = meta.query_start_loc[1:].long() - 1
        starts = list(itertools.accumulate(batch.num_tokens, initial=0))
        every = [self.compute_logits(hidden[starts[r]:starts[r + 1]]) for r in every_token_rows]
        states = [hidden[starts[r]:starts[r + 1]].float() for r in hidden_rows]
        sampled = hidden[last[sample_rows]]
        tokens = self.greedy_tokens(sampled) if greedy and self.greedy_tokens is not None else None
        return (self.compute_logits(sampled) if tokens is None else None), every, tokens, states
