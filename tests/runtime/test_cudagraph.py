"""The piecewise CUDA-graph dispatch, on CPU: capture sizes and padding, and which calls replay a
graph (recorded by stand-ins for torch.cuda's graph and capture context) and which run directly."""

import contextlib

import pytest
import torch

from kiln.runtime.cudagraph import GraphedPiece, default_capture_sizes, pad_tokens, padded_size
from kiln.errors import KilnError


def test_capture_sizes_and_padding_table():
    sizes = default_capture_sizes(40)
    assert sizes == (1, 2, 4, 8, 16, 24, 32, 40)
    assert [padded_size(n, sizes) for n in (1, 3, 5, 8, 9, 33, 40, 41)] == [1, 4, 8, 8, 16, 40, 40, None]
    assert default_capture_sizes(3) == (1, 2)
    slots = pad_tokens(torch.tensor([5, 6, 7]), 8, -1)
    assert slots.tolist() == [5, 6, 7, -1, -1, -1, -1, -1]  # padded tokens write no KV cache
    assert pad_tokens(slots, 8, -1) is slots


class Graph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


captured: list[tuple[Graph, object]] = []


@contextlib.contextmanager
def capture(graph, pool=None):
    captured.append((graph, pool))
    yield


def test_replays_captured_sizes_and_runs_others_directly():
    calls = []
    weight = torch.randn(4)

    def piece(x, w):
        calls.append(x.shape[0])
        return [x * w]

    captured.clear()
    graphed = GraphedPiece(piece, token_args=[0], sizes=[2, 8], pool="pool", graph_type=Graph, capture=capture)
    for n in (8, 2):  # start-up: the first call at each size captures, largest first
        graphed(torch.zeros(n, 4), weight)
    graphed.sealed = True
    assert calls == [8, 8, 2, 2]  # each warmed up once outside the graph, then captured
    assert [pool for _, pool in captured] == ["pool", "pool"]
    x = torch.randn(2, 4)
    out = graphed(x, weight)
    graph, buffers, outputs = graphed._graphs[2]
    assert graph.replays == 2 and out is outputs and torch.equal(buffers[0], x)  # input copied, not re-run
    assert calls == [8, 8, 2, 2]
    big, small = graphed._graphs[8][1][0], graphed._graphs[2][1][0]
    assert small.data_ptr() == big.data_ptr() and big.shape == (8, 4)  # one largest-size buffer for all sizes
    direct = graphed(torch.ones(9, 4), weight)  # above the largest size: no graph
    assert calls[-1] == 9 and torch.equal(direct[0], weight.expand(9, 4))
    with pytest.raises(KilnError, match="after start-up"):
        graphed.capture(4, [torch.zeros(4, 4), weight])


def test_padded_batches_give_the_unpadded_outputs(demo_dirs, kiln_cache, llama_artifact):
    """On CPU the same dispatch pads and runs the pieces directly: the padded rows must change nothing."""
    from kiln import LLM, SamplingParams

    prompts = ["The kiln was", "Clay", "A potter's wheel"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    padded = LLM(demo_dirs["llama"], compile=True, cache_dir=kiln_cache, require_artifact=True,
                 cudagraph_sizes=(1, 2, 4, 8))
    forward = padded.engine.runner.forward
    inner, counts = forward.graph, []
    starts = next(i for i, spec in enumerate(forward.inputs) if spec.name == "query_start_loc")
    forward.graph = lambda *args: counts.append((args[inner.tokens_at].shape[0], args[starts].shape[0] - 1)) or inner(
        *args)
    got = padded.generate(prompts, params)
    assert (4, 4) in counts  # three sequences decoding: padded to 4, a fourth one-token sequence (still all decodes)
    assert all(n in (1, 2, 4, 8) or n > 8 for n, _ in counts)
    plain = LLM(demo_dirs["llama"], compile=True, cache_dir=kiln_cache, require_artifact=True).generate(prompts, params)
    for g, p in zip(got, plain):
        assert g.token_ids == p.token_ids
        torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(p.logprobs), atol=1e-5, rtol=0)


def test_a_non_contiguous_argument_keeps_its_strides():
    seen = []
    graphed = GraphedPiece(lambda x: seen.append(x.stride()) or [x], token_args=[0], sizes=[2, 4], graph_type=Graph,
                           capture=capture)
    x = torch.randn(2, 4).t()  # 4 tokens, strides (1, 4)
    graphed(x)  # warm-up and capture, both on the buffer
    assert seen == [(1, 4), (1, 4)] and graphed._inputs == {}
    assert torch.equal(graphed._graphs[4][1][0], x)
