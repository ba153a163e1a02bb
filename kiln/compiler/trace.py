"""Trace the decoder backbone once with Dynamo into one aten-level FX graph.

The only dynamic dimensions are the token count (input_ids, positions, slot_mapping) and the KV
cache's block count; Dynamo's guards are dropped because the runtime guarantees the input contract.
Dynamo's graph is then retraced to aten ops (kiln ops stay whole, as `torch.ops.kiln.*.default`),
the form the passes and Inductor's pattern matcher work on; no functionalization happens here.
"""

import logging
import time
from dataclasses import dataclass

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.compiler.counters import counters
from kiln.compiler.contract import GraphInput
from kiln.kernels import AttentionMetadata
from kiln.kernels.kv_cache import row_size
from kiln.models.llama import CausalLM

logger = logging.getLogger(__name__)

EXAMPLE_TOKENS = 9  # any size above 1: Dynamo specializes 0 and 1


@dataclass
class TracedBackbone:
    graph: fx.GraphModule
    inputs: list[GraphInput]
    dynamo_graph: str = ""
    """Dynamo's graph (torch-level code), before the retrace to aten."""
    decompiled: str = ""
    """Dynamo's rewritten bytecode of the traced function, decompiled to Python by depyf."""


def _decompile_dynamo_code(fn) -> str:
    """What Dynamo made of `fn`: the bytecode that calls the captured graph, as Python source."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    try:
        import depyf

        return "".join(depyf.decompile(entry.code) for entry in _debug_get_cache_entry_list(fn.__code__))
    except Exception as e:  # depyf lags new Python bytecode; this text is for people, never for loading
        return f"# depyf could not decompile Dynamo's bytecode: {type(e).__name__}: {e}\n"


def _example_batch(model: CausalLM):
    """A batch of one prefill on the model's device (its weights' device: Dynamo refuses a mix)."""
    cfg, n, device = model.config, EXAMPLE_TOKENS, model.cos_sin_cache.device
    kv_caches = [
        torch.zeros(2, 4, 16, model.layout.num_kv_heads, row_size(cfg.head_dim, model.cache_dtype),
                    dtype=model.cache_dtype, device=device)
        for _ in range(cfg.num_layers)
    ]
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.arange(4, dtype=torch.int32, device=device)[None],
    )
    ids, positions = torch.arange(n, device=device), torch.arange(n, device=device)
    for t in (ids, positions, meta.slot_mapping):
        torch._dynamo.mark_dynamic(t, 0)
    for t in kv_caches:
        torch._dynamo.mark_dynamic(t, 1)
    return ids, positions, kv_caches, meta


def _graph_inputs(graph: fx.GraphModule, example_inputs: list, model: CausalLM, batch) -> list[GraphInput]:
    """Name each graph input by the object it was traced from (sizes: by the input dim carrying them)."""
    ids, positions, kv_caches, meta = batch
    sources = {id(t): GraphInput("weight", n) for n, t in (*model.named_parameters(), *model.named_buffers())}
    sources[id(ids)], sources[id(positions)] = GraphInput("input", "input_ids"), GraphInput("input", "positions")
    sources |= {id(t): GraphInput("kv_cache", str(i)) for i, t in enumerate(kv_caches)}
    sources |= {id(getattr(meta, f)): GraphInput("meta", f) for f in meta.__dataclass_fields__}
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    inputs: list[GraphInput] = []
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if isinstance(value, torch.Tensor):
            inputs.append(sources[id(value)])
            continue
        symbol = str(node.meta["example_value"])
        owner = next(
            (
                (j, d)
                for j, p in enumerate(placeholders)
                if isinstance(p.meta.get("example_value"), torch.Tensor)
                for d, size in enumerate(p.meta["example_value"].shape)
                if str(size) == symbol
            ),
            None,
        )
        if owner is None:
            raise RuntimeError(f"traced graph input {node.name} = {symbol} is no dimension of any input tensor")
        inputs.append(GraphInput("size", symbol, of=owner[0], dim=owner[1]))
    return inputs


def _to_aten(graph: fx.GraphModule) -> fx.GraphModule:
    """Retrace Dynamo's graph (torch functions, methods, op packets) into aten ops and op overloads,
    on the fake inputs Dynamo traced with, keeping its symbolic sizes."""
    values = [n.meta["example_value"] for n in graph.graph.nodes if n.op == "placeholder"]
    with detect_fake_mode(values):
        return make_fx(graph, tracing_mode="real")(*values)


def _unexecuted(graph: fx.GraphModule):
    """A stand-in for the captured graph that returns empty tensors shaped like its outputs. The
    example call only drives Dynamo: running the graph would be wasted work and, under tensor
    parallelism, wait forever on collectives the other ranks never join."""
    output = next(n for n in reversed(graph.graph.nodes) if n.op == "output")
    values = [n.meta["example_value"] for n in fx.node.map_arg(output.args[0], lambda n: n)]

    def hint(size) -> int:
        return size.node.hint if isinstance(size, torch.SymInt) else size

    tensors = tuple(torch.empty([hint(s) for s in v.shape], dtype=v.dtype, device=v.device) for v in values)
    return lambda *args: tensors


def trace_backbone(model: CausalLM) -> TracedBackbone:
    """Trace `model.forward` once (fullgraph) and return the graph with its input contract."""
    start = time.perf_counter()
    captured = {}

    def backend(gm: fx.GraphModule, example_inputs: list):
        captured["graph"], captured["inputs"] = gm, example_inputs
        return _unexecuted(gm)

    def backbone(input_ids, positions, kv_caches, attn_metadata):
        n = input_ids.size(0)  # one token-count symbol for every per-token tensor
        torch._check(positions.size(0) == n)
        torch._check(attn_metadata.slot_mapping.size(0) == n)
        return model(input_ids, positions, kv_caches, attn_metadata)

    batch = _example_batch(model)
    # `backbone` is one code object for every model: reset so a second trace is not a Dynamo recompile
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(backbone, backend=backend, fullgraph=True)(*batch)
    decompiled = _decompile_dynamo_code(backbone)
    torch._dynamo.reset()
    counters["graphs_traced"] += 1
    inputs = _graph_inputs(captured["graph"], captured["inputs"], model, batch)
    graph = _to_aten(captured["graph"])
    logger.info("traced backbone: %d nodes in %.2fs", len(graph.graph.nodes), time.perf_counter() - start)
    return TracedBackbone(graph, inputs, captured["graph"].code, decompiled)
