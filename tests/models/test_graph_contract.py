"""docs/architecture.md, compile step 1: the backbone traces as one graph, per-layer state enters as inputs, and
every middle decoder layer is the same graph (so the compiler can compile it once)."""

import torch
from torch.fx import Node

from kiln import LLM
from kiln.compiler.trace import trace_backbone


def _signature(node: Node):
    """A node's op and its non-tensor arguments, with tensor arguments reduced to 'a node'."""
    args = tuple("node" if isinstance(a, Node) else a for a in node.args)
    return str(node.target), args


def _layer_segments(llm: LLM) -> list:
    graph = trace_backbone(llm.model).graph
    calls = [n for n in graph.graph.nodes if n.op == "call_function"]
    attn = [i for i, n in enumerate(calls) if n.target in (torch.ops.kiln.attention, torch.ops.kiln.attention.default)]
    assert len(attn) == llm.model_config.num_layers
    assert not [n for n in graph.graph.nodes if n.op == "get_attr"]  # no constants baked per layer
    return [[_signature(n) for n in calls[a:b]] for a, b in zip(attn, attn[1:])]


def test_layers_trace_to_identical_segments(demo_dirs):
    segments = _layer_segments(LLM(demo_dirs["qwen3"], max_num_seqs=1))
    assert len(segments) == 3 and all(seg == segments[0] for seg in segments)


def test_a_per_layer_constant_would_be_caught(demo_dirs):
    llm = LLM(demo_dirs["qwen3"], max_num_seqs=1)
    llm.model.model.layers[2].self_attn.scale = 0.5
    segments = _layer_segments(llm)
    assert not all(seg == segments[0] for seg in segments)
