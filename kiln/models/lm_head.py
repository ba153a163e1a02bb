"""Kernels for the LM head: hidden @ W.T over the vocabulary, the largest single matmul of a small
model's decode step (Qwen2.5-0.5B's is 545 MB in fp32, more than a third of what a token reads).

`PackedHead` runs it on a oneDNN-packed copy of the weight (what a CPU artifact asks for when the
compiler measured it faster); where the CPU has bf16 arithmetic it also picks greedy tokens without
the fp32 logits (`GreedyScreen`), exactly, from half the bytes. `Int8Head` is the opt-in int8 head
(`LLM(lm_head_quantization="int8")`, `--lm-head-quantization int8`): weights per output channel,
activations per token, a quarter of fp32's bytes; its effect on greedy agreement is what `benchmarks/quantization.py` reports. "w7a8"
keeps 7-bit weight codes, which fbgemm multiplies on CPUs without VNNI without splitting the rows.
"""

import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from kiln.config import LM_HEAD_QUANTIZATIONS, cpu_has_native_bf16
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
    """hidden @ weight.T with the weight packed once in `format` (`kiln.kernels.packed_linear`).

    `screen` (default: an fp32 weight on a CPU with bf16 arithmetic) gives it a `GreedyScreen`, built
    on the first greedy call (about 0.5 s for Qwen2.5's head): a start does not wait for it, and a
    process that only samples never holds it. `pending_bytes` is what it will take until then."""

    def __init__(self, weight: torch.Tensor, format: str = "onednn", screen: bool | None = None):
        self.weight = packed_linear.pack(format, weight)
        if screen is None:
            screen = format == "onednn" and weight.dtype == torch.float32 and weight.device.type == "cpu" \
                and cpu_has_native_bf16()
        self.screen: GreedyScreen | None = None
        self._plain = weight if screen else None  # the weight the screen is built from, until it is

    @property
    def screens(self) -> bool:
        """Whether greedy calls go through a screen (built or still to build)."""
        return self.screen is not None or self._plain is not None

    @property
    def pending_bytes(self) -> int:
        """Memory the screen will take when it is built: its bf16 copy and the buffer that packs it."""
        if self._plain is None:
            return 0
        vocab, k = self._plain.shape
        return (vocab + min(vocab, SCREEN_PACK_ROWS)) * k * 2

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return ops.onednn_linear(hidden, self.weight, None)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The argmax token of each row's logits, without computing them; None where this head cannot
        tell (no screen, or the screen gave up): compute the logits then."""
        if self._plain is not None:
            start = time.perf_counter()
            self.screen, self._plain = GreedyScreen(self._plain), None
            logger.info("built the LM head's greedy screen (bf16, %d blocks) in %.2fs", len(self.screen.blocks),
                        time.perf_counter() - start)
        return self.screen(hidden) if self.screen is not None else None


BF16_UNIT_ROUNDOFF = 2.0 ** -8
"""bf16 keeps 8 significant bits: rounding to nearest moves a value by at most this fraction of it."""
SCREEN_BLOCK = 128
"""The screen finds each row's leaders among blocks of this many logits first, then inside the blocks
that can hold one: two short passes instead of comparing every logit with the row's threshold."""
SCREEN_PACK_ROWS = 32768
"""The bf16 copy is converted and packed this many rows at a time, through one buffer: 60 MB of fresh
memory faulted in for it instead of the whole copy's 272 MB (Qwen2.5's head; on a VM, page faults cost
more than the copy), and the GEMM runs per block at the same speed."""
SCREEN_MAX_CANDIDATES = 1024
"""Per row, on average: more candidate tokens (or blocks) than this, logits too close to call (e.g. a
hidden state of zeros), and the screen gives up: the fp32 logits are computed instead. Computing
1024 candidates reads 1024 rows of W, under 1% of Qwen2.5's head."""


class GreedyScreen:
    """The argmax of the fp32 logits hidden @ W.T, reading a bf16 copy of W: half the bytes of the
    largest matmul of a small model's decode step (a quarter of Qwen2.5-0.5B's), and twice the FLOP
    rate of fp32 where the CPU has bf16 arithmetic. Exact: the bf16 logits bound every fp32 logit,
    and only the tokens whose bound reaches the leader's are computed again in fp32.

    The bound. A bf16 logit y_i differs from the fp32 one f_i by at most
    c * sum_j |W_ij h_j| <= c * |W_i| |h| <= c * R |h| (Cauchy-Schwarz; R the largest row norm of W), with
    c = 3.25 u + 4 gamma: u for rounding each of W, h and the bf16 output, gamma = (K + 1) 2^-24 / (1 -
    (K + 1) 2^-24) for summing K products in fp32 (bf16 products are exact in fp32), in the bf16 GEMM and
    in f itself; the 0.25 u covers the second-order terms. So the token with the largest f has
    y >= max(y) - 2 c R |h|, and every such token is a candidate; the fp32 argmax of the candidates (the
    first of equal ones, as torch's argmax) is the argmax of all."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.detach()  # the fp32 rows candidates are computed from (the model keeps them)
        vocab, k = weight.shape
        gamma = (k + 1) * 2.0 ** -24 / (1 - (k + 1) * 2.0 ** -24)
        self.c = 3.25 * BF16_UNIT_ROUNDOFF + 4 * gamma
        self.tiny = k * 2.0 ** -126
        """Per unit of |h| + R: what bf16 kernels that flush subnormal inputs to zero can lose on top."""
        self.blocks, norms = [], []
        buffer = torch.empty(min(vocab, SCREEN_PACK_ROWS), k, dtype=torch.bfloat16)
        for rows in self.weight.split(SCREEN_PACK_ROWS):
            block = buffer[: len(rows)]
            block.copy_(rows)
            self.blocks.append(packed_linear.pack("onednn", block))
            norms.append(torch.linalg.vector_norm(rows, dim=1).max())
        self.max_row_norm = float(max(norms))

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, K] fp32 hidden states -> [rows] int64 argmax tokens, or None if the screen cannot tell."""
        h = hidden.to(torch.bfloat16)
        y = torch.cat([ops.onednn_linear(h, block, None) for block in self.blocks], 1) if len(self.blocks) > 1 \
            else ops.onednn_linear(h, self.blocks[0], None)
        norm = torch.linalg.vector_norm(hidden, dim=1)
        window = 2 * self.c * self.max_row_norm * norm + self.tiny * (norm + self.max_row_norm)
        rows, vocab = y.shape
        if vocab % SCREEN_BLOCK == 0:
            blocks = y.view(rows, vocab // SCREEN_BLOCK, SCREEN_BLOCK)
            block_max = blocks.amax(-1).float()
            threshold = block_max.amax(-1) - window
            if not torch.isfinite(threshold).all():  # NaN, or an infinite logit: let the fp32 logits decide
                return None
            row, block = (block_max >= threshold[:, None]).nonzero(as_tuple=True)
            if len(row) > rows * SCREEN_MAX_CANDIDATES:
                return None
            i, offset = (blocks[row, block].float() >= threshold[row, None]).nonzero(as_tuple=True)
            row, token = row[i], block[i] * SCREEN_BLOCK + offset
        else:
            y = y.float()
            threshold = y.amax(-1) - window
            if not torch.isfinite(threshold).all():
                return None
            row, token = (y >= threshold[:, None]).nonzero(as_tuple=True)
        if len(row) > rows * SCREEN_MAX_CANDIDATES:
            return None
        exact = torch.linalg.vecdot(self.weight[token], hidden[row])  # (row, token) pairs in order
        best = torch.full((rows,), float("-inf"), device=hidden.device).scatter_reduce(0, row, exact, "amax")
        lead = (exact == best[row]).nonzero().squeeze(1)
        first = torch.ones_like(lead, dtype=torch.bool)
        first[1:] = row[lead[1:]] != row[lead[:-1]]
        return token[lead[first]]


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
