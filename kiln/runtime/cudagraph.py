"""Piecewise CUDA graphs: one graph per (compiled piece, capture size), captured at start-up.

The runner pads each batch's token count up to the next capture size (`padded_size`; padded tokens
carry token 0, position 0 and slot -1, so they write no KV cache), runs the program at that size,
and keeps the first n rows of the result. Each compiled piece then replays the graph captured for
that size: its per-token arguments are copied into persistent buffers the graph reads; weights and
KV caches are the same tensors at every call. Each argument has one buffer of the largest size, whose
first rows every size's graph reads, so the buffers take one batch's memory per piece, not one per
size. Attention runs eagerly between the pieces. Above the largest capture size, pieces run without
graphs. Graphs are captured largest first into one shared memory pool, and only at start-up: a
capture while serving raises.
"""

import bisect
from collections.abc import Callable, Sequence

import torch

from kiln.errors import KilnError


def default_capture_sizes(max_size: int) -> tuple[int, ...]:
    """1, 2, 4, then every multiple of 8 up to `max_size` (decode batches are small and common)."""
    return tuple(s for s in (1, 2, 4, *range(8, max_size + 1, 8)) if s <= max_size)


def padded_size(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest capture size that holds `n` tokens; None above the largest (no graph)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def pad_tokens(x: torch.Tensor, size: int, value: int) -> torch.Tensor:
    """`x` with its first dimension padded to `size` with `value`."""
    if x.shape[0] == size:
        return x
    return torch.cat([x, x.new_full((size - x.shape[0], *x.shape[1:]), value)])


class GraphedPiece:
    """A compiled piece that replays a CUDA graph per capture size.

    `token_args`: the argument positions whose first dimension is the token count; the others must
    be the same tensors at every call (weights, KV caches). `graph_type` and `capture` are
    torch.cuda's by default; tests substitute recorders to check the dispatch on CPU.
    """

    def __init__(self, fn: Callable, token_args: Sequence[int], sizes: Sequence[int], pool=None,
                 graph_type=None, capture=None):
        self.fn, self.token_args, self.sizes = fn, tuple(token_args), tuple(sorted(sizes))
        self.pool = pool
        self._graph_type = graph_type or torch.cuda.CUDAGraph
        self._capture = capture or torch.cuda.graph
        self._graphs: dict[int, tuple] = {}  # size -> (graph, input buffers, outputs)
        self._inputs: dict[int, torch.Tensor] = {}  # token argument -> its buffer at the largest size
        self.sealed = False
        """Set once start-up captured every size: a later capture is a bug (it would stall a step)."""

    def capture(self, size: int, args: list) -> None:
        """Capture the graph for `size` tokens on `args` (start-up only: largest size first, so the
        smaller ones reuse the pool memory the largest took)."""
        if self.sealed:
            raise KilnError(f"a CUDA graph capture (size {size}) was asked for after start-up: every capture "
                            "size is captured before serving")
        buffers = {i: self._buffer(i, args[i], size) for i in self.token_args}
        call = [buffers.get(i, a) for i, a in enumerate(args)]
        self.fn(*call)  # warm-up outside the graph: lazy initialization must not be captured
        graph = self._graph_type()
        with self._capture(graph, pool=self.pool):
            outputs = self.fn(*call)
        self._graphs[size] = (graph, buffers, outputs)

    def _buffer(self, i: int, arg: torch.Tensor, size: int) -> torch.Tensor:
        """Argument i's input buffer for the graph at `size` tokens, holding `arg`: the first `size`
        rows of one largest-size buffer that every size's graph reads (one graph runs at a time, and
        its inputs are copied in just before). An argument that is not contiguous gets its own copy:
        a prefix view would not have its strides."""
        if not arg.is_contiguous():
            return arg.clone()
        if i not in self._inputs:
            self._inputs[i] = arg.new_empty((self.sizes[-1], *arg.shape[1:]))
        buffer = self._inputs[i][:size]
        buffer.copy_(arg)
        return buffer

    def __call__(self, *args):
        n = args[self.token_args[0]].shape[0] if self.token_args else None
        if n not in self.sizes:  # above the largest capture size, or no token argument at all
            return self.fn(*args)
        if n not in self._graphs:  # the start-up pass at this size: capture, then replay
            self.capture(n, list(args))
        graph, buffers, outputs = self._graphs[n]
        for i, buffer in buffers.items():
            buffer.copy_(args[i])
        graph.replay()
        return outputs
