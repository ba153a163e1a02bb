"""The LM head's greedy screen (`kiln.models.lm_head.GreedyScreen`) as one C++ kernel: quantize the
hidden states, bound their error, run the int8 panel GEMM over the vocabulary, and compute again in
fp32 only the tokens that can beat the int8 leader, in one call.

In Python the screen's arithmetic is some forty small torch ops a step (norms in fp64, a block
maximum, a threshold, the candidates' rows), a noticeable share of a small model's batch-1 step.
Here they cost microseconds, and the second core scans its own half of the logits while they are in its cache. The bound is the one
`GreedyScreen` documents, row by row. Like the panel GEMMs the kernel is C++ that AOTInductor
builds into a library the artifact ships (`kiln.compiler.libraries`); the op's own function is
the reference.
"""

import torch

from kiln.kernels import cpp_source, panel_linear, quant

SOURCE = cpp_source.read("greedy_screen.cpp")
"""The kernel's C++ (csrc/greedy_screen.cpp, which holds the int8 panel GEMM's), with its C entry point
`kiln_greedy_screen`."""
WRAPPER_SOURCE = cpp_source.read("greedy_screen_shim.cpp")
"""kiln::greedy_screen as the C shim function `SHIM`, which its library's wrapper calls."""

LIBRARY = "greedy_screen"
"""The kernel's library's name among an artifact's `libraries`."""
LIBRARY_ARGS = (0, 1, 2, 3, 4)
"""Its arguments, as `LoadedLibrary` takes them: all five are tensors."""
SHIM = "aoti_torch_cpu_kiln_greedy_screen"
"""The C shim function in `WRAPPER_SOURCE` a library calls."""


def params(max_row_norm: float, max_quant_row_norm: float, max_error_row_norm: float,
           max_candidates: int) -> torch.Tensor:
    """The op's `params` argument: a screen's row norms of W, of W' and of W - W' (`GreedyScreen`), and
    the candidates per row past which it gives up, as fp64."""
    return torch.tensor([max_row_norm, max_quant_row_norm, max_error_row_norm, max_candidates], dtype=torch.float64)


def int8_head_params() -> torch.Tensor:
    """The op's `params` for an int8 LM head (`kiln.models.lm_head.Int8Head`): a negative cap. `codes` and
    `scales` are then the head itself, `weight` is not read, and the tokens are the argmax of the head's
    logits, exactly: what greedy sampling takes from them, in one call instead of some ten small ops."""
    return torch.tensor([0.0, 0.0, 0.0, -1.0], dtype=torch.float64)


@torch.library.custom_op("kiln::greedy_screen", mutates_args=())
def greedy_screen(hidden: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor,
                  params: torch.Tensor) -> torch.Tensor:
    """The argmax token of each row of hidden [R, K] @ weight.T (weight [V, K] fp32) as int64 [R],
    -1 where the row holds a NaN or an infinity. `codes` (W's int8 codes in panels,
    `panel_linear.pack_int8`), `scales` [V] and `params` (`params`) are what the kernel screens
    with; a kernel may also give -1 for every row when too many tokens come close to tell. With
    `int8_head_params`, the argmax of the int8 head's logits s t (q . c) instead. This function is the
    reference: the logits' argmax."""
    if params[3] < 0:
        codes_plain, (q, s) = panel_linear.unpack_int8(codes), quant.quant_native(hidden, None, torch.int8)
        logits = (q.int() @ codes_plain.int().t()).float().mul_(scales).mul_(s)
    else:
        logits = hidden @ weight.t()
    tokens = logits.argmax(-1)
    return tokens.masked_fill(~torch.isfinite(hidden).all(-1) | torch.isnan(logits).any(-1), -1)


@greedy_screen.register_fake
def _(hidden, codes, scales, weight, params):
    return hidden.new_empty((hidden.shape[0],), dtype=torch.int64)
