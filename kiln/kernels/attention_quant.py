"""Attention whose output is quantized with a static per-tensor scale, in one op.

Created by the attn_quant pass when the attention output feeds a projection with a calibrated
`input_scale` (static W8A8). A kernel that writes int8/fp8 straight from its accumulators never
stores the full-precision output; the native impl is the unfused sequence (the reference). Like
`kiln::attention` it is a splitting op: it runs eagerly between compiled pieces.
"""

import torch

from kiln.kernels.attention import attention_native
from kiln.kernels.quant import quant_fake, quant_native


@torch.library.custom_op("kiln::attention_quant", mutates_args=())
def attention_quant(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    write_done: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    sliding_window: int,
    quant_dtype: torch.dtype,
    out_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kiln::attention`, heads flattened, quantized with `out_scale` -> ([T, Hq * D] int8 or fp8,
    fp32 scale [1, 1])."""
    out = attention_native(query, kv_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window)
    return quant_native(out.flatten(1), out_scale, quant_dtype)


@attention_quant.register_fake
def _(query, kv_cache, write_done, query_start_loc, seq_lens, block_tables, scale, sliding_window, quant_dtype,
      out_scale):
    return quant_fake(query.flatten(1), out_scale, quant_dtype)
