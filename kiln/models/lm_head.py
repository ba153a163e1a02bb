"""Kernels for the LM head: hidden @ W.T over the vocabulary, the largest single matmul of a small
model's decode step (Qwen2.5-0.5B's is 545 MB in fp32, more than a third of what a token reads).

`PackedHead` runs it on a oneDNN-packed copy of the weight (what a CPU artifact asks for when the
compiler measured it faster). `Int8Head` is the opt-in int8 head (`LLM(lm_head_quantization="int8")`,
`--lm-head-quantization int8`): weights per output channel, activations per token, a quarter of
fp32's bytes; its effect on greedy agreement is what `benchmarks/quantization.py` reports. "w7a8"
keeps 7-bit weight codes, which fbgemm multiplies on CPUs without VNNI without splitting the rows.
"""

import functools
import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from kiln.config import LM_HEAD_QUANTIZATIONS
from kiln.errors import KilnError
from kiln.kernels import packed_linear, quantize_weight
from kiln.models.quantization import SCHEMES

logger = logging.getLogger(__name__)
ops = torch.ops.kiln

_FBGEMM = ("fbgemm_int8", "fbgemm_w7a8")
FBGEMM_PACK_ROWS = 40_000
"""fbgemm packs a weight of many more rows than this slower per row (measured: 2.4 s for Qwen2.5's
151936 x 896 head whole, 1.0 s in four blocks): an int8 head on fbgemm is packed, and runs, in blocks
of at most this many rows, packed concurrently."""


class PackedHead:
    """hidden @ weight.T with the weight packed once in `format` (`kiln.kernels.packed_linear`)."""

    def __init__(self, weight: torch.Tensor, format: str = "onednn"):
        self.weight = packed_linear.pack(format, weight)

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return ops.onednn_linear(hidden, self.weight, None)


class Int8Head:
    """W8A8 logits: per-token int8 activations x per-channel int8 weights, int32 accumulation, fp32
    out. On a CPU the weight is packed for oneDNN's int8 GEMM where it is exact (VNNI), else for
    fbgemm's (split rows for 8-bit codes, whole ones for 7-bit codes: `weight_max` 63); elsewhere
    torch._int_mm runs it."""

    def __init__(self, weight: torch.Tensor, weight_max: float | None = None):
        codes, self.scale = quantize_weight(weight.detach(), torch.int8, weight_max)
        self.kernel = None
        if codes.device.type == "cpu":
            seven_bit = weight_max is not None and weight_max <= packed_linear.W7A8_MAX
            fbgemm = "fbgemm_w7a8" if seven_bit else "fbgemm_int8"
            self.kernel = "onednn_int8" if packed_linear.int8_gemm_exact() else \
                fbgemm if packed_linear.fbgemm_available() else None
        if self.kernel in _FBGEMM:
            count = -(-codes.shape[0] // FBGEMM_PACK_ROWS)
            blocks = codes.split(-(-codes.shape[0] // count))
            with ThreadPoolExecutor(torch.get_num_threads()) as pool:  # packing a block uses one thread
                self.codes = list(pool.map(functools.partial(packed_linear.pack, self.kernel), blocks))
        else:
            self.codes = packed_linear.pack(self.kernel, codes) if self.kernel else codes

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        a, a_scale = ops.quant_int8(hidden, None)
        if self.kernel == "onednn_int8":
            return ops.onednn_int8_linear(packed_linear.shift_int8(a), self.codes, self.scale).mul_(a_scale)
        if self.kernel in _FBGEMM:
            linear = packed_linear.fbgemm_w7a8_linear if self.kernel == "fbgemm_w7a8" else \
                packed_linear.fbgemm_int8_linear
            outs = [linear(a, block) for block in self.codes]
            return (torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]).mul_(a_scale).mul_(self.scale)
        return ops.scaled_mm(a, self.codes, a_scale, self.scale, torch.float32, None)


def quantize_lm_head(model, scheme: str) -> None:
    """Give `model` (a CausalLM with its weights loaded) an int8 LM head ("int8", or "w7a8": 7-bit
    weight codes), in place."""
    if scheme not in LM_HEAD_QUANTIZATIONS:
        raise KilnError(f"unknown LM head quantization {scheme!r}; choose from {', '.join(LM_HEAD_QUANTIZATIONS)}")
    weight = model.lm_head_weight()
    model.lm_head_kernel = Int8Head(weight, SCHEMES[scheme].weight_max)
    logger.info("LM head quantized to %s (%d x %d): %.0f MB instead of %.0f MB", scheme, *weight.shape,
                weight.numel() / 1e6, weight.numel() * weight.element_size() / 1e6)
