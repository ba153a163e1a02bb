"""Kernels for the LM head: hidden @ W.T over the vocabulary, the largest single matmul of a small
model's decode step (Qwen2.5-0.5B's is 545 MB in fp32, more than a third of what a token reads).

`PackedHead` runs it on a packed copy of the weight, on oneDNN or on kiln's panel GEMM (what a CPU
artifact asks for when the compiler measured it faster; the panel GEMMs ship in the artifact as
libraries of their own); where the CPU has an exact int8 GEMM it also picks greedy tokens without the
fp32 logits (`GreedyScreen`), exactly, from a quarter of the bytes. `Int8Head` is the
opt-in int8 head (`LLM(lm_head_quantization="int8")`, `--lm-head-quantization int8`): weights per
output channel, activations per token and block of 32 where an artifact ships kiln's blocked int8 GEMM
for it (any x86 CPU with AVX2), else per token, a quarter of fp32's bytes; its effect on greedy agreement is
what `benchmarks/quantization.py` reports. "w7a8" keeps 7-bit weight codes, which fbgemm multiplies
on CPUs without VNNI without splitting the rows.
"""

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from kiln.config import LM_HEAD_QUANTIZATIONS
from kiln.errors import KilnError
from kiln.kernels import gemms, greedy_screen, packed_linear, panel_linear, quantize_weight
from kiln.kernels.quant import ACT_BLOCK
from kiln.models.quantization import SCHEMES
from kiln.weights import huge_pages
from kiln.weights.formats import pack as pack_format

logger = logging.getLogger(__name__)
ops = torch.ops.kiln

_FBGEMM = (gemms.FBGEMM_INT8.id, gemms.FBGEMM_W7A8.id)
_PANELS8_INT8_BLOCK = gemms.PANELS8_INT8_BLOCK.id
_ONEDNN, _PANELS, _ONEDNN_INT8, _PANELS_INT8 = (c.id for c in (gemms.ONEDNN, gemms.PANELS16, gemms.ONEDNN_INT8,
                                                          gemms.PANELS16_INT8))
FBGEMM_PACK_ROWS = 40_000
"""fbgemm packs a weight of many more rows than this slower per row (a large vocabulary's head packs
about twice as fast in blocks): an int8 head on fbgemm is packed, and runs, in blocks of at most this
many rows, packed concurrently."""


def int8_kernel(seven_bit: bool = False) -> str | None:
    """The int8 GEMM an LM head runs on this CPU: oneDNN's where it is exact (VNNI or AMX), else
    fbgemm's (on 7-bit weight codes as they are, on 8-bit ones through split rows); None where
    neither is (`gemms.int8_head_kernel`)."""
    kernel = gemms.int8_head_kernel(seven_bit)
    return kernel.id if kernel is not None else None


def screen_kernel() -> str | None:
    """The int8 GEMM a greedy screen runs: its codes are 7-bit where fbgemm runs it (exact on AVX2
    too, without the split)."""
    return int8_kernel(seven_bit=True)


HeadGemm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""gemm(x, packed weight) -> [rows, vocab] fp32: a panel GEMM (`kiln.kernels.panel_linear`) as the
artifact ships it for the head (`kiln.compiler.libraries`), or as a compile times it."""
Packer = Callable[[str, torch.Tensor], torch.Tensor]
"""packer(format, weight) -> the packed weight: `kiln.weights.formats.pack`, or a cache's (`kiln.weights.pack_cache`)."""
ScreenLibrary = Callable[..., list[torch.Tensor]]
"""The greedy screen's library (`kiln.kernels.greedy_screen`, shipped by `kiln.compiler.libraries`):
(hidden, codes, scales, weight, params) -> [tokens]."""


class PackedHead:
    """hidden @ weight.T with the weight packed once in `format` (`kiln.kernels.gemms`): on oneDNN,
    or for the panel format on `gemm`, kiln's panel GEMM.

    `screen` (default: an fp32 weight on a CPU with an exact int8 GEMM, `screen_kernel`) gives it a
    `GreedyScreen`, built on the first greedy call: a start
    does not wait for it, and a process that only samples never holds it. `pending_bytes` is what it
    will take until then. `screen_gemm` (the int8 panel GEMM) runs the screen where given, and
    `screen_library` (`kiln.kernels.greedy_screen`'s) the whole screen on it."""

    def __init__(self, weight: torch.Tensor, format: str = _ONEDNN, screen: bool | None = None,
                 gemm: HeadGemm | None = None, screen_gemm: HeadGemm | None = None,
                 screen_library: ScreenLibrary | None = None, packer: Packer | None = None):
        if (format == _PANELS) != (gemm is not None):
            raise KilnError(f"an LM head packed as {format!r} runs on {'a' if gemm is None else 'no'} panel GEMM "
                            f"library: pass `gemm` with {_PANELS!r} only")
        self.weight = (packer or pack_format)(format, weight)
        self.gemm = gemm
        if screen is None:
            screen = format in (_ONEDNN, _PANELS) and weight.dtype == torch.float32 and weight.device.type == "cpu"
        self.screen_kernel = (_PANELS_INT8 if screen_gemm is not None else screen_kernel()) if screen else None
        self.screen: GreedyScreen | None = None
        self._screen_gemm, self._screen_fused = screen_gemm, screen_library
        self._plain = weight if self.screen_kernel else None  # the weight the screen is built from, until it is

    @property
    def screens(self) -> bool:
        """Whether greedy calls go through a screen (built or still to build)."""
        return self.screen is not None or self._plain is not None

    @property
    def pending_bytes(self) -> int:
        """Memory the screen will take when it is built: its int8 copy with a scale a row, and the
        block of codes it is packed from."""
        if self._plain is None:
            return 0
        vocab, k = self._plain.shape
        return vocab * (k + 4) + min(vocab, SCREEN_PACK_ROWS) * k

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.gemm is not None:
            return self.gemm(hidden, self.weight)
        return ops.onednn_linear(hidden, self.weight, None)

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The argmax token of each row's logits, without computing them; None where this head cannot
        tell (no screen, or the screen gave up): compute the logits then."""
        if self._plain is not None:
            start = time.perf_counter()
            self.screen = GreedyScreen(self._plain, self.screen_kernel, self._screen_gemm, self._screen_fused)
            self._plain = None
            logger.info("built the LM head's greedy screen (int8 on %s, %d blocks%s) in %.2fs", self.screen_kernel,
                        len(self.screen.blocks), ", one kernel" if self._screen_fused else "",
                        time.perf_counter() - start)
        return self.screen(hidden) if self.screen is not None else None


UNIT_ROUNDOFF = 2.0 ** -24
"""fp32 rounding to nearest moves a value by at most this fraction of it."""
SCREEN_BLOCK = 128
"""The screen finds each row's leaders among blocks of this many logits first, then inside the blocks
that can hold one: two short passes instead of comparing every logit with the row's threshold."""
SCREEN_PACK_ROWS = 32768
"""The int8 copy is quantized and packed this many rows at a time: 29 MB of codes in flight for
Qwen2.5's head instead of the whole copy's 136 MB, and the GEMM runs per block at the same speed."""
SCREEN_MAX_CANDIDATES = 1024
"""Per row, on average: more candidate tokens (or blocks) than this, logits too close to call (e.g. a
hidden state of zeros), and the screen gives up: the fp32 logits are computed instead. Computing
1024 candidates reads 1024 rows of W, under 1% of Qwen2.5's head."""


class GreedyScreen:
    """The argmax of the fp32 logits hidden @ W.T, from an int8 GEMM on an int8 copy of W: a quarter
    of the bytes of the largest matmul of a small model's decode step. Exact: the int8 logits bound
    every fp32 logit, and only the tokens whose bound reaches the fp32 logit of the int8 leader are
    computed again in fp32.

    The bound. h is quantized per row to codes q with scale s, h' = s q; row i of W to codes c_i with
    scale t_i, W'_i = t_i c_i. The GEMM sums q . c_i exactly in int32 and returns y_i = t_i (q . c_i),
    rounded twice in fp32, so s y_i = h' . W'_i (1 + d), |d| <= 2.01 u. An fp32 logit f_i differs from
    h . W_i by at most gamma |h| |W_i| (summing K products; gamma = (K + 1) u / (1 - (K + 1) u)), and
    h . W_i - h' . W'_i = (h - h') . W_i + h' . (W_i - W'_i). So (Cauchy-Schwarz)
    |f_i - s y_i| <= B = |h - h'| R + |h'| D + 3.01 u |h'| R' + gamma |h| R, with R, R' and D the
    largest row norms of W, W' and W - W', measured at build (D from W' rounded to fp32, which may miss
    u R': the third u covers it). A token with f_i >= f_L, L the int8 argmax, has
    y_i >= (f_L - B - 2 gamma |h| R) / s (f_L is computed apart from the candidates, so in another
    order of sums, maybe): those are the candidates, and the fp32 argmax of the candidates (the first
    of equal ones, as torch's argmax) is the argmax of all. A step's norms are taken in fp64; those of W in fp32, raised
    by 2 gamma, so their own rounding stays inside.

    On the int8 panel GEMM, an artifact's `kiln.kernels.greedy_screen` library runs all of this as one
    kernel (`fused`), row by row; the torch ops here are its fallback elsewhere."""

    def __init__(self, weight: torch.Tensor, kernel: str = _ONEDNN_INT8, gemm: HeadGemm | None = None,
                 fused: ScreenLibrary | None = None):
        """`kernel`: the int8 GEMM's weight format; the int8 panel format runs on `gemm`, and its blocks are
        packed into one weight, which `fused` (the screen as one kernel) reads where given."""
        if (kernel == _PANELS_INT8) != (gemm is not None) or fused is not None and gemm is None:
            raise KilnError(f"a greedy screen on {kernel!r} runs on {'a' if gemm is None else 'no'} panel GEMM "
                            f"library: pass `gemm` with {_PANELS_INT8!r} only")
        vocab, k = weight.shape
        if gemm is not None and (vocab % panel_linear.PANEL or SCREEN_PACK_ROWS % panel_linear.PANEL):
            raise KilnError(f"a vocabulary of {vocab} is not whole panels of {panel_linear.PANEL} rows: the screen "
                            "cannot run on the panel GEMM")
        self.weight = weight.detach()  # the fp32 rows candidates are computed from (the model keeps them)
        self.kernel, self.gemm = kernel, gemm
        self.gamma = (k + 1) * UNIT_ROUNDOFF / (1 - (k + 1) * UNIT_ROUNDOFF)
        weight_max = packed_linear.W7A8_MAX if kernel == gemms.FBGEMM_W7A8.id else None
        panels = huge_pages.empty(weight.shape, torch.int8) if gemm is not None else None
        self.blocks, self.scales, norms = [], [], torch.zeros(3)
        for start in range(0, vocab, SCREEN_PACK_ROWS):
            rows = self.weight[start:start + SCREEN_PACK_ROWS]
            codes, scale = quantize_weight(rows, torch.int8, weight_max)
            if panels is not None:  # a block of whole panels: the packed rows are the block's
                panel_linear.pack_int8(codes, out=panels[start:start + len(rows)])
            else:
                self.blocks.append(pack_format(kernel, codes))
            self.scales.append(scale)
            norms = torch.maximum(norms, self._norms(rows, codes, scale))
        if panels is not None:
            huge_pages.collapse_later(panels)
            self.blocks, self.scales = [panels], [torch.cat(self.scales)]
        self.max_row_norm, self.max_quant_row_norm, self.max_error_row_norm = (norms * (1 + 2 * self.gamma)).tolist()
        self.fused = fused if self.weight.is_contiguous() else None  # the kernel reads rows of W in place
        self.params = greedy_screen.params(self.max_row_norm, self.max_quant_row_norm, self.max_error_row_norm,
                                           SCREEN_MAX_CANDIDATES)

    @staticmethod
    def _norms(rows: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """The largest row norms of W, W' and W - W' over one block, a few MB of rows at a time."""
        out = torch.zeros(3)
        for w, c, t in zip(rows.split(2048), codes.split(2048), scale.split(2048)):
            quant = c.float().mul_(t[:, None])
            norms = [torch.linalg.vector_norm(w, dim=1).max(), torch.linalg.vector_norm(quant, dim=1).max()]
            norms.append(torch.linalg.vector_norm(quant.sub_(w), dim=1).max())
            out = torch.maximum(out, torch.stack(norms))
        return out

    def _logits(self, codes: torch.Tensor) -> torch.Tensor:
        """[rows, K] int8 codes -> [rows, vocab] fp32 t_i (q . c_i)."""
        if self.gemm is not None:
            return self.gemm(codes, self.blocks[0]).mul_(self.scales[0])
        if self.kernel == _ONEDNN_INT8:
            a = packed_linear.shift_int8(codes)
            outs = [ops.onednn_int8_linear(a, block, scale) for block, scale in zip(self.blocks, self.scales)]
        else:
            outs = [packed_linear.fbgemm_w7a8_linear(codes, block).mul_(scale)
                    for block, scale in zip(self.blocks, self.scales)]
        return torch.cat(outs, 1) if len(outs) > 1 else outs[0]

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[rows, K] fp32 hidden states -> [rows] int64 argmax tokens, or None if the screen cannot tell."""
        if self.fused is not None:
            tokens = self.fused(hidden.contiguous(), self.blocks[0], self.scales[0], self.weight, self.params)[0]
            return None if bool((tokens < 0).any()) else tokens
        y, s, window = self._screen_logits(hidden)
        rows, vocab = y.shape
        blocked = vocab % SCREEN_BLOCK == 0
        if blocked:
            blocks = y.view(rows, vocab // SCREEN_BLOCK, SCREEN_BLOCK)
            block_max = blocks.amax(-1)
            top = block_max.argmax(-1)
            lead = top * SCREEN_BLOCK + blocks[torch.arange(rows), top].argmax(-1)
        else:
            lead = y.argmax(-1)
        # a token beats the int8 leader only if its bound reaches the leader's fp32 logit
        lead_logit = torch.linalg.vecdot(self.weight[lead], hidden).double()
        threshold = ((lead_logit - window) / s.double()).float()
        threshold = torch.nextafter(threshold, threshold.new_tensor(float("-inf")))  # rounded down, not to nearest
        if not bool(torch.isfinite(threshold).all()):  # NaN or infinite: let the fp32 logits decide
            return None
        if blocked:
            row, block = (block_max >= threshold[:, None]).nonzero(as_tuple=True)
            if len(row) > rows * SCREEN_MAX_CANDIDATES:
                return None
            i, offset = (blocks[row, block] >= threshold[row, None]).nonzero(as_tuple=True)
            row, token = row[i], block[i] * SCREEN_BLOCK + offset
        else:
            row, token = (y >= threshold[:, None]).nonzero(as_tuple=True)
        if len(row) > rows * SCREEN_MAX_CANDIDATES:
            return None
        exact = torch.linalg.vecdot(self.weight[token], hidden[row])  # (row, token) pairs in order
        best = torch.full((rows,), float("-inf"), device=hidden.device).scatter_reduce(0, row, exact, "amax")
        lead = (exact == best[row]).nonzero().squeeze(1)
        first = torch.ones_like(lead, dtype=torch.bool)
        first[1:] = row[lead[1:]] != row[lead[:-1]]
        return token[lead[first]]

    def _screen_logits(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[rows, K] fp32 hidden states -> (y [rows, vocab] fp32, the scale s [rows] that makes s y the
        logits, and the window [rows] fp64 below the leader's fp32 logit that holds every candidate:
        the class's B and the 2 gamma |h| R of recomputing the leader).

        A row whose quantization error outweighs the weight's (|h - h'| R > |h'| D: a few outlier
        channels set a coarse scale) gets a second row of codes, its residual h - h' quantized in turn:
        the GEMM sums both, and the error left is the residual's residual, two orders smaller."""
        codes, s = ops.quant_int8(hidden, None)
        h, quant = hidden.double(), codes.double().mul_(s.double())
        norm, quant_norm = torch.linalg.vector_norm(h, dim=1), torch.linalg.vector_norm(quant, dim=1)
        error = torch.linalg.vector_norm(quant.sub_(h), dim=1)
        wide = (error * self.max_row_norm > quant_norm * self.max_error_row_norm).nonzero().squeeze(1)
        if len(wide) == 0:
            y = self._logits(codes)
            rounding = 3.01 * UNIT_ROUNDOFF * quant_norm
        else:
            residual = quant[wide].neg_().float()  # h - h' (rounded to fp32: the bound counts the codes it gets)
            residual_codes, residual_s = ops.quant_int8(residual, None)
            both = self._logits(torch.cat([codes, residual_codes]))
            y, residual_y = both[: len(codes)], both[len(codes):]
            ratio = residual_s.squeeze(1) / s[wide].squeeze(1)
            y[wide] = residual_y.mul_(ratio[:, None]).add_(y[wide])  # (s y + s_r y_r) / s, three more roundings
            rest = quant[wide].add_(residual_codes.double().mul_(residual_s.double()))  # h' + h'_r - h
            error = error.clone()
            error[wide] = torch.linalg.vector_norm(rest, dim=1)
            residual_norm = torch.zeros_like(norm)
            residual_norm[wide] = torch.linalg.vector_norm(residual_codes.double() * residual_s.double(), dim=1)
            quant_norm = quant_norm + residual_norm  # |h' + h'_r| <= |h'| + |h'_r|
            rounding = 6.01 * UNIT_ROUNDOFF * quant_norm
        bound = error * self.max_row_norm + quant_norm * self.max_error_row_norm \
            + rounding * self.max_quant_row_norm + self.gamma * norm * self.max_row_norm
        return y, s.squeeze(1), bound + 2 * self.gamma * norm * self.max_row_norm


_INT8_HEAD = greedy_screen.int8_head_params()


class Int8Head:
    """W8A8 logits: per-token int8 activations x per-channel int8 weights, int32 accumulation, fp32
    out. On a CPU the weight is packed for oneDNN's int8 GEMM where it is exact (VNNI), else for
    fbgemm's (split rows for 8-bit codes, whole ones for 7-bit codes: `weight_max` 63); elsewhere
    torch._int_mm runs it."""

    def __init__(self, weight: torch.Tensor, weight_max: float | None = None, pack: bool = True):
        """`pack` False: keep the plain codes until `pack` or `run_on_panels` (an artifact's load decides
        which), so that loading one quantizes and packs the head once."""
        self.codes, self.scale = quantize_weight(weight.detach(), torch.int8, weight_max)
        self.seven_bit = weight_max is not None and weight_max <= packed_linear.W7A8_MAX
        self.gemm, self.packed = None, False
        self._greedy: ScreenLibrary | None = None
        self.kernel = None
        if self.codes.device.type == "cpu":
            self.kernel = int8_kernel(seven_bit=self.seven_bit)
        if pack:
            self.pack()

    def pack(self) -> None:
        """Pack the codes for the kernel chosen at build (once; a head that runs on panels is packed)."""
        if self.packed:
            return
        codes, self.packed = self.codes, True
        if self.kernel in _FBGEMM:
            count = -(-codes.shape[0] // FBGEMM_PACK_ROWS)
            blocks = codes.split(-(-codes.shape[0] // count))
            with ThreadPoolExecutor(torch.get_num_threads()) as pool:  # packing a block uses one thread
                self.codes = list(pool.map(functools.partial(pack_format, self.kernel), blocks))
        elif self.kernel:
            self.codes = pack_format(self.kernel, codes)

    def run_on_panels(self, gemm: HeadGemm, packer: Packer | None = None,
                      greedy_library: ScreenLibrary | None = None) -> bool:
        """Run on an artifact's int8 panel GEMM (`gemm`, the int8 panel format), which streams the head faster
        than oneDNN's int8 GEMM on one row: the plain codes packed in panels (by `packer`, default
        `kiln.weights.formats.pack`), and greedy tokens on `greedy_library` (the greedy screen's, which
        takes them from the panels in one call) where given. False, and nothing changed, where the head is
        packed already or its shape has no panels."""
        if self.packed or self.codes.device.type != "cpu" or self.codes.shape[0] % panel_linear.PANEL \
                or self.codes.shape[1] % 4:
            return False
        self.codes, self.kernel, self.gemm = (packer or pack_format)(_PANELS_INT8, self.codes), \
            _PANELS_INT8, gemm
        self.packed, self._greedy = True, greedy_library
        return True

    @property
    def blocks(self) -> bool:
        """Whether an artifact may run this head with activations per block of 32 (8-bit codes on a CPU)."""
        return not self.seven_bit and self.codes.device.type == "cpu" and self.codes.shape[1] % ACT_BLOCK == 0

    def run_on_blocked_panels(self, gemm: Callable[..., torch.Tensor], packer: Packer | None = None) -> bool:
        """Run on an artifact's blocked int8 panel GEMM (`gemm(a, a_scale, packed)`): activations quantized per
        token and block of 32 as the projections' are (as llama.cpp's Q8_0 output; per token costs
        SmolLM2-135M +0.5% perplexity), on AVX2 as on AVX-512, with no greedy screen (its bound is per token's).
        False, and nothing changed, where the head is packed already or cannot."""
        if self.packed or not self.blocks or self.codes.shape[0] % panel_linear.INT4_PANEL:
            return False
        self.codes = (packer or pack_format)(_PANELS8_INT8_BLOCK, self.codes)
        self.kernel, self.gemm, self.packed = _PANELS8_INT8_BLOCK, gemm, True
        return True

    @property
    def screens(self) -> bool:
        """Whether greedy calls take their tokens from one kernel (`greedy`) rather than from the logits."""
        return self._greedy is not None

    pending_bytes = 0
    """Memory a greedy call will add: none (it reads the head's own codes)."""

    def greedy(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The argmax token of each row's logits, as `self(hidden).argmax(-1)` gives it, in one kernel call
        (the greedy screen's library on the head's panels: no logits tensor, no sampling ops after the
        weight stream); None where it cannot tell (no library, not fp32, a NaN or an infinity)."""
        if self._greedy is None or hidden.dtype != torch.float32:
            return None
        tokens = self._greedy(hidden.contiguous(), self.codes, self.scale, self.scale[:, None], _INT8_HEAD)[0]
        return None if bool((tokens < 0).any()) else tokens

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        self.pack()
        if self.kernel == _PANELS8_INT8_BLOCK:
            a, a_scale = ops.quant_int8_blocked(hidden, ACT_BLOCK)
            return self.gemm(a, a_scale, self.codes).mul_(self.scale)
        a, a_scale = ops.quant_int8(hidden, None)
        if self.kernel == _PANELS_INT8:
            return self.gemm(a, self.codes).mul_(self.scale).mul_(a_scale)
        if self.kernel == _ONEDNN_INT8:
            return ops.onednn_int8_linear(packed_linear.shift_int8(a), self.codes, self.scale).mul_(a_scale)
        if self.kernel in _FBGEMM:
            linear = packed_linear.fbgemm_w7a8_linear if self.kernel == gemms.FBGEMM_W7A8.id else \
                packed_linear.fbgemm_int8_linear
            outs = [linear(a, block) for block in self.codes]
            return (torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]).mul_(a_scale).mul_(self.scale)
        return ops.scaled_mm(a, self.codes, a_scale, self.scale, torch.float32, None)


def quantize_lm_head(model, scheme: str, pack: bool = True) -> None:
    """Give `model` (a CausalLM with its weights loaded) an int8 LM head ("int8", or "w7a8": 7-bit
    weight codes), in place; `pack` False leaves packing to the artifact's load (`Int8Head`)."""
    if scheme not in LM_HEAD_QUANTIZATIONS:
        raise KilnError(f"unknown LM head quantization {scheme!r}; choose from {', '.join(LM_HEAD_QUANTIZATIONS)}")
    weight = model.lm_head_weight()
    model.lm_head_kernel = Int8Head(weight, SCHEMES[scheme].weight_max, pack=pack)
    model.lm_head_quantization = scheme  # a key factor: the artifact ships the head's kernel for it
    logger.info("LM head quantized to %s (%d x %d): %.0f MB instead of %.0f MB", scheme, *weight.shape,
                weight.numel() / 1e6, weight.numel() * weight.element_size() / 1e6)
