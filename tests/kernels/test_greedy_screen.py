"""The greedy screen as one C++ kernel, as its library runs it: the fp32 argmax of the logits (the op's
reference) on heads built to fool an int8 screen, the same tokens as the screen's torch ops, and no
answer where it cannot tell. For an int8 head, the argmax of that head's own logits."""

import pytest
import torch

from kiln.compiler import libraries
from kiln.compiler.aoti import LoadedLibrary
from kiln.kernels import cpp_lowering, greedy_screen, panel_linear
from kiln.models.lm_head import SCREEN_MAX_CANDIDATES, GreedyScreen, Int8Head
from tests.models.test_lm_head import near_tied_head

pytestmark = pytest.mark.skipif(panel_linear.available((64, 64), torch.int8) is not None,
                                reason="no int8 panel GEMM on this CPU")


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    path = tmp_path_factory.mktemp("screen") / "greedy_screen.so"
    path.write_bytes(libraries.build([libraries.GREEDY_SCREEN])[greedy_screen.LIBRARY].library)
    return LoadedLibrary(path, greedy_screen.LIBRARY_ARGS)


def screens(weight: torch.Tensor, library) -> tuple[GreedyScreen, GreedyScreen]:
    """The screen on the kernel, and on its torch ops (the same int8 copy)."""
    gemm = panel_linear.timing_kernel(panel_linear.INT8)
    return GreedyScreen(weight, "panels16_int8", gemm, library), GreedyScreen(weight, "panels16_int8", gemm)


def test_kernel_picks_the_fp32_argmax_of_near_ties(library):
    weight, hidden = near_tied_head()
    fused, ops = screens(weight, library)
    ref = (hidden @ weight.t()).argmax(-1)
    assert torch.equal(torch.ops.kiln.greedy_screen(hidden, fused.blocks[0], fused.scales[0], weight, fused.params), ref)
    int8 = ops._logits(torch.ops.kiln.quant_int8(hidden, None)[0])
    assert (int8.gather(1, ref[:, None]).squeeze(1) < int8.amax(-1)).any()  # int8 alone picks other tokens
    assert torch.equal(fused(hidden), ref) and torch.equal(ops(hidden), ref)
    assert torch.equal(fused(hidden[2:3]), ref[2:3])


@pytest.mark.parametrize("rows", [1, 16, 21])  # one row; a full group of 16; a second group, residual rows too
def test_kernel_matches_fp32_on_a_wide_random_head(library, rows):
    """Random logits, no token far ahead, at Qwen2.5-0.5B's width; rows with outlier channels, whose
    quantization residual gets a second row of codes, and a row at a thousandth of the scale."""
    g = torch.Generator().manual_seed(2)
    weight, hidden = torch.randn(4096, 896, generator=g) * 0.02, torch.randn(rows, 896, generator=g)
    hidden[0, 11] = 30.0
    hidden[rows // 2] *= 1e-3
    hidden[-1, 7] = 40.0
    fused, ops = screens(weight, library)
    ref = (hidden @ weight.t()).argmax(-1)
    assert torch.equal(fused(hidden), ref) and torch.equal(ops(hidden), ref)


def test_kernel_gives_up_where_it_cannot_tell(library):
    weight, hidden = near_tied_head()
    fused, _ = screens(weight, library)
    run = lambda h: library(h, fused.blocks[0], fused.scales[0], weight, fused.params)[0]  # noqa: E731
    assert run(torch.zeros(2, 64)).tolist() == [-1, -1]  # every logit ties: more candidates than the cap
    assert fused(torch.zeros(2, 64)) is None
    nan = hidden.clone()
    nan[1, 3] = float("nan")
    got = run(nan)
    assert got[1] == -1 and torch.equal(got[[0, 2, 3, 4]], (hidden @ weight.t()).argmax(-1)[[0, 2, 3, 4]])
    assert torch.ops.kiln.greedy_screen(nan, fused.blocks[0], fused.scales[0], weight, fused.params)[1] == -1
    assert fused(nan) is None
    inf = hidden.clone()
    inf[0, 0] = float("inf")
    assert fused(inf) is None
    no_cap = greedy_screen.params(fused.max_row_norm, fused.max_quant_row_norm, fused.max_error_row_norm, 0)
    assert (library(hidden, fused.blocks[0], fused.scales[0], weight, no_cap)[0] == -1).all()  # no candidate allowed
    assert SCREEN_MAX_CANDIDATES == fused.params[3]


def test_library_is_shipped_for_a_screen_on_the_int8_panels(monkeypatch):
    assert libraries.screen_wanted({"format": "panels16", "screen": "panels16_int8"})
    assert not libraries.screen_wanted({"format": "panels16", "screen": None})  # on oneDNN's or fbgemm's
    assert not libraries.screen_wanted(None)
    monkeypatch.setattr(cpp_lowering, "register", lambda: False)
    assert not libraries.screen_wanted({"format": "panels16", "screen": "panels16_int8"})


@pytest.mark.parametrize("rows", [1, 16, 21])
def test_kernel_gives_an_int8_heads_argmax(library, rows):
    """An int8 head's greedy tokens from the kernel are its logits' argmax (the op's reference, and the
    head run then sampled): exact ties included, whose twin rows sit in both threads' halves of the
    vocabulary and twice in the first half (the first wins), and rows with outlier channels (no
    residual codes for a head)."""
    g = torch.Generator().manual_seed(3)
    weight, hidden = torch.randn(4096, 896, generator=g) * 0.02, torch.randn(rows, 896, generator=g)
    hidden[0, 11] = 30.0
    for r in range(0, rows, 2):  # twins, each row's best: the lower index must win
        weight[100 + r] = weight[200 + r] = weight[3000 + r] = hidden[r] / hidden[r].norm() * 0.5
    head = Int8Head(weight, pack=False)
    assert head.run_on_panels(panel_linear.timing_kernel(panel_linear.INT8), greedy_library=library)
    want = head(hidden).argmax(-1)
    assert want[0] == 100 and (rows < 3 or want[2] == 102)
    got = head.greedy(hidden)
    assert got is not None and torch.equal(got, want)
    params = greedy_screen.int8_head_params()
    assert torch.equal(torch.ops.kiln.greedy_screen(hidden, head.codes, head.scale, weight, params), want)
    nan = hidden.clone()
    nan[-1, 5] = float("nan")
    out = library(nan, head.codes, head.scale, head.scale[:, None], params)[0]
    assert out[-1] == -1 and torch.equal(out[:-1], want[:-1])
    assert head.greedy(nan) is None  # the logits decide
    assert head.greedy(hidden.double()) is None


def test_int8_head_without_the_library_has_no_greedy_path():
    head = Int8Head(torch.randn(64, 64), pack=False)
    assert head.run_on_panels(panel_linear.timing_kernel(panel_linear.INT8))
    assert not head.screens and head.greedy(torch.randn(2, 64)) is None
