"""Trace once, split at attention, compile unique pieces: compiled outputs equal eager outputs."""

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.compiler.counters import counters
from kiln.compiler.split import split_graph
from kiln.compiler.trace import trace_backbone
from kiln.models.demo import write_demo_model
from tests.oracle import PROMPTS

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=0)
MIXED = {"max_num_seqs": 3, "max_num_batched_tokens": 16}  # chunked prefills mixed with decodes


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_compiled_equals_eager(demo_dirs, kiln_cache, arch):
    eager = LLM(demo_dirs[arch], **MIXED).generate(PROMPTS, GREEDY)
    counters.clear()
    llm = LLM(demo_dirs[arch], compile=True, cache_dir=kiln_cache, **MIXED)
    if arch != "llama" or counters["graphs_traced"]:  # llama's artifact may already be built by another test
        got = dict(counters)
        made = got.pop("pieces_compiled", 0) + got.pop("pieces_cached", 0)  # cached: another test compiled it
        # blobs: the three unique pieces and the decode attention library
        assert made == 3 and got == {"graphs_traced": 1, "pieces": 5, "pieces_reused": 2, "blobs_saved": 4,
                                     "blobs_loaded": 4}
    program, calls = llm.engine.runner.forward, []
    llm.engine.runner.forward = lambda *a: calls.append(1) or program(*a)
    compiled = llm.generate(PROMPTS, GREEDY)
    assert len(calls) > 16  # every step, prefill chunks and decodes alike, ran the compiled program
    for c, e in zip(compiled, eager):
        assert c.token_ids == e.token_ids
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(e.logprobs), atol=1e-4, rtol=0)


def test_split_gives_2l_plus_1_pieces(demo_dirs):
    llm = LLM(demo_dirs["qwen3"], max_num_seqs=1)
    traced = trace_backbone(llm.model)
    _, pieces = split_graph(traced.graph)
    assert len(pieces) == 2 * 4 + 1
    assert [p.is_splitting for p in pieces] == [i % 2 == 1 for i in range(9)]
    inputs = traced.inputs
    kinds = {i.kind for i in inputs}
    assert kinds == {"weight", "input", "meta", "kv_cache", "size"}
    assert sum(i.kind == "kv_cache" for i in inputs) == 4


def test_unique_blobs_do_not_grow_with_depth(tmp_path, llama_artifact, kiln_cache):
    model_dir = write_demo_model(tmp_path / "l16", arch="llama", num_layers=16, train_steps=0)
    counters.clear()
    llm = LLM(model_dir, compile=True, cache_dir=kiln_cache)
    # the 4-layer model's three unique pieces are the same graphs for the same inputs: the piece
    # cache serves all three, and the artifact holds the same three libraries (and the decode attention's)
    assert counters["pieces"] == 17 and counters["pieces_cached"] == 3 and counters["pieces_compiled"] == 0
    assert counters["blobs_saved"] == 4
    blobs = {p.name for p in (llm.artifact_path / "blobs").glob("*.so")}
    assert blobs == {p.name for p in (llama_artifact / "blobs").glob("*.so")} and len(blobs) == 4
    out = llm.generate(["The kiln"], GREEDY)[0]
    assert out.token_ids == LLM(model_dir).generate(["The kiln"], GREEDY)[0].token_ids


def test_registered_splitting_op_adds_cuts(demo_dirs):
    from kiln.compiler.split import SPLITTING_OPS, add_splitting_op

    graph = trace_backbone(LLM(demo_dirs["llama"], max_num_seqs=1).model).graph
    add_splitting_op(torch.ops.kiln.silu_and_mul)
    try:
        _, pieces = split_graph(graph)
    finally:
        SPLITTING_OPS.discard(torch.ops.kiln.silu_and_mul)
    assert sum(p.is_splitting for p in pieces) == 8 and len(pieces) == 17  # 4 attentions + 4 MLP activations


def test_a_model_off_the_cpu_traces_and_compiles_for_its_own_device(demo_dirs):
    """Dynamo runs on the example batch: it must sit on the weights' device (a CUDA model traced on
    CPU examples fails at the embedding), and so must a static size's examples. Checked with meta
    weights, which fake tensors let mix with CPU ones silently."""
    from kiln.compiler.compile import _static_examples
    from kiln.models.config import ModelConfig
    from kiln.models.registry import create_model

    model = create_model(ModelConfig.from_model_dir(demo_dirs["llama"]), torch.float32, device="meta")
    traced = trace_backbone(model)
    examples = [n.meta["val"] for n in traced.graph.graph.find_nodes(op="placeholder")]
    tensors = [v for v in examples if isinstance(v, torch.Tensor)]
    assert {v.device.type for v in tensors} == {"meta"}
    ids = next(i for i, spec in enumerate(traced.inputs) if spec.name == "input_ids")
    static, _ = _static_examples(examples, str(examples[ids].shape[0]), 4)
    assert [v.device for v in static if isinstance(v, torch.Tensor)] == [v.device for v in tensors]
    assert static[ids].shape == (4,)
