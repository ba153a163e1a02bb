"""Compile each unique piece with Inductor, for a symbolic token count.

Pieces whose graphs are the same up to input names (every middle decoder layer) are compiled once.
"""

import copy
import hashlib
import logging
import time
from collections.abc import Callable

import torch
from torch import fx
from torch._guards import detect_fake_mode

from kiln.compiler.counters import counters
from kiln.compiler.program import CompiledProgram
from kiln.compiler.split import Piece, split_graph
from kiln.compiler.trace import trace_backbone
from kiln.models.llama import CausalLM

logger = logging.getLogger(__name__)


def normalize(graph: fx.GraphModule) -> fx.GraphModule:
    """A copy whose inputs are named arg0..argN, so identical layers print identical code."""
    g = copy.deepcopy(graph)
    for i, node in enumerate(n for n in g.graph.nodes if n.op == "placeholder"):
        node.name = node.target = f"arg{i}"
    g.recompile()
    return g


def piece_key(graph: fx.GraphModule) -> str:
    return hashlib.sha256(graph.code.encode()).hexdigest()


def _returns_tuple(graph: fx.GraphModule) -> bool:
    output = next(n for n in reversed(graph.graph.nodes) if n.op == "output")
    return isinstance(output.args[0], (tuple, list))


def _callable(artifact, as_tuple: bool) -> Callable:
    """Compiled artifacts return a list (or, in process, a bare tensor); restore the piece's form."""

    def run(*args):
        out = artifact(*args)
        if as_tuple:
            return tuple(out)
        return out[0] if isinstance(out, (list, tuple)) else out

    return run


def compile_pieces(pieces: list[Piece]) -> dict[str, Callable]:
    """Compile every non-splitting piece (unique graphs once); returns name -> callable."""
    by_key: dict[str, object] = {}
    compiled: dict[str, Callable] = {}
    for piece in pieces:
        if piece.is_splitting:
            continue
        counters["pieces"] += 1
        graph = normalize(piece.graph)
        key = piece_key(graph)
        if key not in by_key:
            start = time.perf_counter()
            example = [n.meta["example_value"] for n in piece.graph.graph.nodes if n.op == "placeholder"]
            by_key[key] = torch._inductor.standalone_compile(
                graph, example, dynamic_shapes="from_example_inputs", fake_mode=detect_fake_mode(example)
            )
            counters["pieces_compiled"] += 1
            logger.info("compiled %s (%s) in %.2fs", piece.name, key[:12], time.perf_counter() - start)
        else:
            counters["pieces_reused"] += 1
        compiled[piece.name] = _callable(by_key[key], _returns_tuple(piece.graph))
    return compiled


def install(stitched: fx.GraphModule, compiled: dict[str, Callable]) -> fx.GraphModule:
    """Swap compiled callables in for the pieces the stitching module calls."""
    for name, fn in compiled.items():
        del stitched._modules[name]
        stitched.__dict__[name] = fn
    return stitched


def compile_backbone(model: CausalLM) -> CompiledProgram:
    """Trace, split and compile `model`'s backbone in this process; stage timings go to INFO."""
    timings = {}
    start = time.perf_counter()
    traced = trace_backbone(model)
    timings["trace"] = time.perf_counter() - start
    start = time.perf_counter()
    stitched, pieces = split_graph(traced.graph)
    timings["split"] = time.perf_counter() - start
    start = time.perf_counter()
    compiled = compile_pieces(pieces)
    timings["compile"] = time.perf_counter() - start
    logger.info("compile stages: %s", ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()))
    return CompiledProgram(install(stitched, compiled), traced.inputs, model)
