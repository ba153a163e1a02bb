"""Trace quantized demo models once per test and run the traced graph itself, before and after passes."""

import copy

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.compiler.contract import weight_indices
from kiln.runtime.program import CompiledProgram, PackedWeights
from kiln.weights.packing import pack_weights
from kiln.compiler.trace import TracedBackbone, trace_backbone
from kiln.config import EngineConfig
from kiln.models.quantization import QuantLinear
from kiln.runtime.engine import Engine
from tests.oracle import PROMPTS
from tests.quant_checkpoints import calibrate, write_compressed

SCHEMES = ["int8", "fp8", "int8-static", "fp8-static"]


@pytest.fixture(scope="session")
def quantized_llms(demo_dirs, hf_models, tmp_path_factory) -> dict[str, LLM]:
    """The demo llama quantized seven ways: online per-token int8/fp8 (int8 as a GPU runs it: on a CPU
    `--quantization int8` quantizes activations per block of 32, "int8-blocked"; and w7a8, int8 with 7-bit
    weight codes: its activations are per-token int8's; and int4, W4A8 in groups), and compressed-tensors
    checkpoints with calibrated static activation scales. On the CPU on any machine: the GEMM choice these tests check is the CPU's, and int4
    runs there only (a GPU machine's default device refuses it)."""
    amax = calibrate(hf_models["llama"], demo_dirs["llama"])
    root = tmp_path_factory.mktemp("static")
    llms = {s: LLM(demo_dirs["llama"], quantization=s, device="cpu") for s in ("int8", "w7a8", "fp8", "int4")}
    llms["int8-blocked"] = llms["int8"]
    llms["int8"] = LLM(demo_dirs["llama"], quantization="int8", device="cpu")
    for module in llms["int8"].model.modules():
        if isinstance(module, QuantLinear):
            module.act_block = 0
    for s in ("int8", "fp8"):
        llms[f"{s}-static"] = LLM(write_compressed(demo_dirs["llama"], root / s, s, input_amax=amax), device="cpu")
    llms[None] = LLM(demo_dirs["llama"], device="cpu")
    return llms


@pytest.fixture(scope="session")
def traced_graphs(quantized_llms) -> dict:
    return {scheme: trace_backbone(llm.model) for scheme, llm in quantized_llms.items()}


def fresh(traced: TracedBackbone) -> TracedBackbone:
    """A copy a pass may rewrite without touching the shared trace."""
    return TracedBackbone(copy.deepcopy(traced.graph), traced.inputs)


def run_graph(llm: LLM, traced: TracedBackbone, prompts, params, weight_formats: dict[str, str] | None = None):
    """Generate with `traced`'s graph run eagerly as the model's forward (no Inductor involved), the
    weights named in `weight_formats` packed as a loaded artifact's are."""
    saved = llm.engine
    graph = traced.graph
    if weight_formats:
        graph = PackedWeights(graph, pack_weights(weight_indices(traced.inputs), llm.model, [weight_formats])[0])
    program = CompiledProgram(graph, traced.inputs, llm.model)
    llm.engine = Engine(llm.model, EngineConfig(), llm.tokenizer, forward=program)
    try:
        return llm.generate(prompts, params)
    finally:
        llm.engine = saved


def assert_same_outputs(llm: LLM, rewritten: TracedBackbone, original: TracedBackbone,
                        weight_formats: dict[str, str] | None = None, atol: float = 1e-5) -> None:
    """Greedy tokens identical and logprobs within `atol`: the rewrite kept the graph's meaning."""
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
    for got, want in zip(run_graph(llm, rewritten, PROMPTS, params, weight_formats),
                         run_graph(llm, original, PROMPTS, params)):
        assert got.token_ids == want.token_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=atol, rtol=0)
