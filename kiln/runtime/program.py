"""What runs a token: an artifact's compiled backbone as a callable with `CausalLM.forward`'s
arguments, its variants picked by token count, its weights bound once (`kiln.compiler.contract`
says where each graph input comes from), and on CUDA its pieces replayed as graphs.
"""

import dataclasses
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from kiln.compiler.contract import GraphInput
from kiln.errors import KilnError
from kiln.kernels import AttentionMetadata
from kiln.kernels.attention import one_batch
from kiln.runtime.cudagraph import GraphedPiece, default_capture_sizes, pad_tokens, padded_size
from kiln.weights.pack_cache import PackFile

logger = logging.getLogger(__name__)


@dataclass
class SizedPiece:
    """A compiled piece in its size variants: the static compile for the exact token count if there
    is one, else the dynamic one (None in a variant that serves static sizes only). `tokens` locates
    the token count among the arguments: (index, None) for an int argument, (index, dim) for a
    tensor's dimension."""

    dynamic: Callable | None
    tokens: tuple[int, int | None] | None = None
    static: dict[int, Callable] = field(default_factory=dict)
    returns_tuple: bool = True
    token_args: tuple[int, ...] = ()
    """The arguments whose first dimension is the token count (what a CUDA graph copies in)."""

    def __call__(self, *args):
        fn = self.dynamic
        if self.static and self.tokens is not None:
            i, dim = self.tokens
            fn = self.static.get(args[i] if dim is None else args[i].shape[dim], fn)
        out = fn(*args)
        if self.returns_tuple:
            return tuple(out)
        return out[0] if isinstance(out, (list, tuple)) else out


class ByTokenCount:
    """Calls the program variant that serves the batch's token count: an exact static size first,
    else the size range that holds it."""

    def __init__(self, routes: list[tuple[tuple[int, int], Callable]], tokens_at: int):
        self.routes = sorted(routes, key=lambda r: r[0][1] - r[0][0])  # narrowest first: static sizes
        self.tokens_at = tokens_at

    @property
    def max_num_tokens(self) -> int:
        """The largest batch any variant serves: the compile's max_num_tokens."""
        return max(high for (_, high), _ in self.routes)

    def __call__(self, *args):
        n = args[self.tokens_at].shape[0]
        for (low, high), forward in self.routes:
            if low <= n <= high:
                return forward(*args)
        raise KilnError(f"a batch of {n} tokens is larger than the artifact's max_num_tokens ({self.max_num_tokens}): "
                        f"lower max_num_batched_tokens or compile with a larger --max-num-tokens")


class PackedWeights:
    """A variant's forward with some weight arguments replaced by their packed forms: each variant
    reads the formats its own GEMM choices asked for (`kiln.kernels.gemms`)."""

    def __init__(self, forward: Callable, packed: dict[int, torch.Tensor]):
        self.forward, self.packed = forward, list(packed.items())

    def __call__(self, *args):
        args = list(args)
        for i, weight in self.packed:
            args[i] = weight
        return self.forward(*args)


def program_of(forward: Callable):
    """The stitching program object behind a variant's forward (its attributes are the pieces)."""
    return (forward.forward if isinstance(forward, PackedWeights) else forward).__self__


def load_program(source: str, filename: str, pieces: dict[str, Callable],
                 decode_attention: Callable | None = None) -> Callable:
    """Execute the stitching code of `kiln compile` and bind its compiled pieces, and its attention
    calls to the `decode_attention` library where the artifact ships one."""
    namespace: dict = {"__name__": "kiln_program"}
    exec(compile(source, filename, "exec"), namespace)
    if decode_attention is not None and "attention_call" in namespace:
        namespace["attention_call"] = functools.partial(namespace["attention_call"], decode=decode_attention)
    return namespace["Program"](pieces).forward


class CompiledProgram:
    """Runs `graph` (the split backbone, its pieces compiled) on a model's weights and a batch.

    Weights are bound once here; each call binds only the batch's tensors and sizes.
    """

    def __init__(self, graph: Callable, inputs: list[GraphInput], model: nn.Module,
                 lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.graph, self.inputs = graph, inputs
        weights = dict(model.named_parameters()) | dict(model.named_buffers())
        self._bound = [weights[spec.name] if spec.kind == "weight" else None for spec in inputs]
        self.compute_logits = getattr(model, "compute_logits", None)
        """Logits of the backbone's hidden states: the model's, on `lm_head` (`pack_lm_head`) if given."""
        if lm_head is not None:
            self.compute_logits = functools.partial(model.compute_logits, head=lm_head)
        single = getattr(getattr(model, "layout", None), "world_size", 1) == 1
        head = lm_head if lm_head is not None else getattr(model, "lm_head_kernel", None)
        self.greedy_tokens = head.greedy if single and getattr(head, "screens", False) else None
        """hidden -> argmax tokens without the logits, or None when it cannot tell (`PackedHead.greedy`,
        `Int8Head.greedy`)."""
        self.reserved_bytes = head.pending_bytes if self.greedy_tokens is not None else 0
        """Memory the program takes that the kernel still counts as available when the KV cache is sized:
        the LM head's screen, built on first use."""
        self.pack_file: PackFile | None = None
        """The file its packed weights are read from or written to (`kiln.weights.pack_cache`), if any."""
        self._per_call = [(i, spec) for i, spec in enumerate(inputs) if spec.kind in ("input", "meta", "kv_cache")]
        self._sizes = [(i, spec.of, spec.dim) for i, spec in enumerate(inputs) if spec.kind == "size"]
        self.capture_sizes: tuple[int, ...] = ()
        """Token counts a batch is padded up to (each piece replays a CUDA graph at these on CUDA)."""

    def capture_graphs(self, sizes: tuple[int, ...] | None, kv_caches: list[torch.Tensor], block_size: int,
                       max_size: int) -> None:
        """Pad batches to `sizes` from now on, and on CUDA capture every compiled piece's graph at
        each size, largest first, into one memory pool. `sizes` None: the platform's default (on
        CUDA 1, 2, 4, 8, ... up to `max_size`; on CPU none, since there are no graphs to replay)."""
        device = kv_caches[0].device
        if sizes is None:
            sizes = default_capture_sizes(max_size) if device.type == "cuda" else ()
        self.capture_sizes = tuple(sorted(set(sizes)))
        if device.type != "cuda" or not self.capture_sizes:
            return
        pool = torch.cuda.graph_pool_handle()
        graphed = []
        for program in {program_of(forward) for _, forward in self.graph.routes}:
            for name, piece in list(vars(program).items()):
                if isinstance(piece, SizedPiece) and piece.token_args:
                    graphed.append(GraphedPiece(piece, piece.token_args, self.capture_sizes, pool))
                    setattr(program, name, graphed[-1])
        for size in reversed(self.capture_sizes):  # the first call at each size captures
            self(*_idle_batch([size], kv_caches, block_size))
        for piece in graphed:
            piece.sealed = True

    def run_each_form(self, kv_caches: list[torch.Tensor], block_size: int) -> list[list[int]]:
        """Run every variant itself (not the one a token count picks: a static size would shadow a
        range) on a batch of decodes and on a prefill, writing nothing into the KV caches: every
        kernel binary the program launches from Python is launched once (what `kiln compile` runs to
        build them). The prefill is one 2-token sequence plus decodes, so its positions stay within
        any model's rotary table. Returns the batches' query lengths."""
        batches = []
        for (low, high), forward in self.graph.routes:
            forms = [[1] * low] + ([[2] + [1] * (low - 2)] if high >= 2 else [])
            for query_lens in forms:
                forward(*self._arguments(*_idle_batch(query_lens, kv_caches, block_size)))
            batches += forms
        return batches

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        n = input_ids.shape[0]
        size = padded_size(n, self.capture_sizes) if self.capture_sizes else None
        if size is not None and size != n:
            input_ids, positions = pad_tokens(input_ids, size, 0), pad_tokens(positions, size, 0)
            attn_metadata = _padded_metadata(attn_metadata, size - n)
        with one_batch():  # every layer's attention is of this batch: its plan is found by identity
            out = self.graph(*self._arguments(input_ids, positions, kv_caches, attn_metadata))
        out = out[0] if isinstance(out, (tuple, list)) else out
        return out[:n]

    def _arguments(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                   attn_metadata: AttentionMetadata) -> list:
        """The graph's arguments for this batch: the bound weights, the batch's tensors, the sizes."""
        batch = {"input_ids": input_ids, "positions": positions}
        args = list(self._bound)
        for i, spec in self._per_call:
            if spec.kind == "input":
                args[i] = batch[spec.name]
            elif spec.kind == "meta":
                args[i] = getattr(attn_metadata, spec.name)
            else:
                args[i] = kv_caches[int(spec.name)]
        for i, of, dim in self._sizes:  # after the tensors: a size may precede the tensor it measures
            args[i] = args[of].shape[dim]
        return args


def _padded_metadata(meta: AttentionMetadata, pad: int) -> AttentionMetadata:
    """`meta` with `pad` tokens more, each its own one-token sequence (token 0 at position 0, block 0)
    with slot -1: it writes no KV cache, and a batch of decodes stays one (attention picks its decode
    tiles when every sequence has one token)."""
    seqs, qsl = meta.seq_lens.shape[0], meta.query_start_loc
    return dataclasses.replace(
        meta,
        slot_mapping=pad_tokens(meta.slot_mapping, meta.slot_mapping.shape[0] + pad, -1),
        query_start_loc=torch.cat([qsl, qsl[-1:] + torch.arange(1, pad + 1, dtype=qsl.dtype, device=qsl.device)]),
        seq_lens=pad_tokens(meta.seq_lens, seqs + pad, 1),
        block_tables=pad_tokens(meta.block_tables, seqs + pad, 0),
    )


def _idle_batch(query_lens: list[int], kv_caches: list[torch.Tensor], block_size: int) -> tuple:
    """A batch of sequences with these query lengths and no earlier context, whose slots are all -1:
    running it writes nothing into the KV caches (what graph capture and kernel warm-up run)."""
    device = kv_caches[0].device
    width = -(-max(query_lens) // block_size)
    blocks = (torch.arange(width, device=device) % kv_caches[0].shape[1]).to(torch.int32)
    lens = torch.tensor(query_lens, dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.full((sum(query_lens),), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.cat([lens.new_zeros(1), lens.cumsum(0, dtype=torch.int32)]),
        seq_lens=lens,
        block_tables=blocks[None].expand(len(query_lens), -1).contiguous(),
    )
    tokens = torch.zeros(sum(query_lens), dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n, device=device) for n in query_lens])
    return tokens, positions, kv_caches, meta
