"""DESIGN.md section 3: Dynamo traces the backbone as one graph, per-layer state enters as inputs,
and every middle decoder layer is the same graph (so the compiler can compile it once)."""

import torch
from torch.fx import Node

from kiln import LLM
from kiln.kernels import AttentionMetadata


def _trace(llm: LLM) -> torch.fx.GraphModule:
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    n = 9
    meta = AttentionMetadata(torch.arange(n), torch.tensor([0, n], dtype=torch.int32),
                             torch.tensor([n], dtype=torch.int32), torch.zeros(1, 4, dtype=torch.int32))
    ids, pos = torch.arange(n), torch.arange(n)
    for t in (ids, pos, meta.slot_mapping):
        torch._dynamo.mark_dynamic(t, 0)
    torch._dynamo.reset()
    torch.compile(llm.model, backend=backend, fullgraph=True)(ids, pos, llm.engine.runner.kv_caches, meta)
    assert len(graphs) == 1
    return graphs[0]


def _signature(node: Node):
    """A node's op and its non-tensor arguments, with tensor arguments reduced to 'a node'."""
    args = tuple("node" if isinstance(a, Node) else a for a in node.args)
    return str(node.target), args


def test_layers_trace_to_identical_segments(demo_dirs):
    llm = LLM(demo_dirs["qwen3"], max_num_seqs=1)
    gm = _trace(llm)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    attn = [i for i, n in enumerate(calls) if n.target in (torch.ops.kiln.attention, torch.ops.kiln.attention.default)]
    assert len(attn) == llm.model_config.num_layers == 4
    segments = [[_signature(n) for n in calls[a:b]] for a, b in zip(attn, attn[1:])]
    assert all(seg == segments[0] for seg in segments)
    assert not [n for n in gm.graph.nodes if n.op == "get_attr"]  # no constants baked per layer
    kv_inputs = [n for n in gm.graph.nodes if n.op == "placeholder" and "kv_caches" in n.name]
    assert len(kv_inputs) == 4
