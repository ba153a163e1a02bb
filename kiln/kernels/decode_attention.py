"""Paged attention for a batch of decodes (one query token per sequence) on CPU, as one C++ kernel
that reads K and V where they sit in the cache.

At decode sizes torch's path costs more than the arithmetic: gathering the sequence's blocks, then
SDPA's flash kernel, takes tens of times longer than the scores and the weighted sum themselves. This
kernel walks each sequence's block table itself, each context split into spans worked on by all threads
(every KV head of a span's blocks in one task, so each block is read once, by one core), the spans'
partial softmaxes then merged (flash-decoding).

Like the panel GEMMs it is C++ that AOTInductor compiles into a library (`kiln.compiler.libraries`)
from a graph of the one op, which the artifact ships: a serve start needs no compiler. The op's own
function is the reference.
"""

import torch

from kiln.kernels import cpp_source
from kiln.kernels.attention import attention_native, decode_params

SOURCE = cpp_source.read("decode_attention.cpp")
"""The kernel's C++ (csrc/decode_attention.cpp), with its C entry point `kiln_decode_attention`."""
WRAPPER_SOURCE = cpp_source.read("decode_attention_shim.cpp")
"""kiln::decode_attention as the C shim function `SHIM`, which its library's wrapper calls."""

LIBRARY = "decode_attention"
"""The kernel's library's name among an artifact's `libraries`."""
LIBRARY_ARGS = (0, 1, 2, 3, 4)
"""Its arguments, as `LoadedLibrary` takes them: all five are tensors."""
SHIM = "aoti_torch_cpu_kiln_decode_attention"
"""The C shim function in `WRAPPER_SOURCE` a library calls."""


params = decode_params
"""The op's `params` argument: [scale, window] as fp32 (`attention.decode_params`, which the caller of a
decode library, `attention_native`, makes)."""


@torch.library.custom_op("kiln::decode_attention", mutates_args=())
def decode_attention(query: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """Attention of query [B, Hq, D] fp32, one token of each of B sequences (the last of its context),
    over the paged cache [2, blocks, block_size, kv_heads, D] fp32: block_tables [B, W] and seq_lens
    [B] int32 as in `AttentionMetadata`, params from `params`. This function is the reference; a
    library runs the kernel (`SOURCE`)."""
    b = query.shape[0]
    query_start_loc = torch.arange(b + 1, dtype=torch.int32)
    scale, window = params.tolist()
    return attention_native(query, kv_cache, query_start_loc, seq_lens, block_tables, scale, int(window))


@decode_attention.register_fake
def _(query, kv_cache, block_tables, seq_lens, params):
    return torch.empty_like(query)
