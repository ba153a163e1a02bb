"""Tensor parallelism end to end: two gloo ranks generate what one process generates, eagerly for
every architecture (qwen2's one KV head every rank holds whole) and from the llama's compiled artifact,
and serve it; the allreduce+RMSNorm fusion changes no output."""

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.models.demo import DEMO_ARCHS, MOE_DEMO_ARCHS
from tests.processes import free_port, processes_with, run_ranks, serving
from tests.quant_checkpoints import write_compressed

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
PROMPTS = ["The kiln was", "Clay and fire"]
COMPILED = ("llama",)
"""Compiled over ranks (a compile is ~25 s here); the passes that differ under ranks are the same
for every architecture, and each architecture's compile is tested on one rank (qwen2's with its one KV
head, what each of its ranks holds)."""

RANK = """
import json, sys
from kiln import LLM, SamplingParams
from kiln.compiler.counters import counters
dirs, cache, prompts, compiled, w4a16 = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), sys.argv[4], \
    sys.argv[5]
greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)
SCORED = [5, 17, 99, 200, 31, 7, 300, 12]
out = {"eager": {}, "compiled": {}}
for arch, model_dir in dirs.items():
    eager = LLM(model_dir, tensor_parallel_size=2).generate(prompts, greedy)
    out["eager"][arch] = [o.token_ids for o in eager]
    if arch in ("qwen3_moe", "mixtral"):
        int8 = LLM(model_dir, tensor_parallel_size=2, quantization="int8")
        scored = int8.generate([SCORED], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        out["eager"][arch + "_int8"] = scored.prompt_logprobs[1:]
    if arch not in compiled.split(","):
        continue
    llm = LLM(model_dir, tensor_parallel_size=2, compile=True, cache_dir=cache)
    outs = llm.generate(prompts, greedy)
    out["compiled"][arch] = [o.token_ids for o in outs]
    if arch == "llama":
        manifest = json.loads((llm.artifact_path / "manifest.json").read_text())
        out["matches"] = {p["name"]: p["matches"] for p in manifest["variants"][0]["passes"]}
        out["factors"] = manifest["factors"]["tensor_parallel_size"]
        out["pieces_compiled"] = counters["pieces_compiled"]  # 0: `kiln compile` built what the ranks load
        out["fused"] = [o.logprobs for o in outs]
        out["unfused"] = [o.logprobs for o in eager]  # eager runs all_reduce and the norm as two ops
        int8 = LLM(model_dir, tensor_parallel_size=2, quantization="int8")
        out["int8"] = [o.token_ids for o in int8.generate(prompts, greedy)]
        int4 = LLM(model_dir, tensor_parallel_size=2, quantization="int4")
        out["int4"] = [o.token_ids for o in int4.generate(prompts, greedy)]
        out["int4_groups"] = list(int4.model.model.layers[0].mlp.down_proj.weight_scale.shape)
        packed = LLM(w4a16, tensor_parallel_size=2)
        out["w4a16"] = [o.token_ids for o in packed.generate(prompts, greedy)]
        layer = packed.model.model.layers[0]
        out["w4a16_shapes"] = {name: [list(p.weight.shape), list(p.weight_scale.shape)] for name, p in
                               (("o_proj", layer.self_attn.o_proj), ("down_proj", layer.mlp.down_proj),
                                ("gate_up_proj", layer.mlp.gate_up_proj))}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def w4a16_llama(demo_dirs, tmp_path_factory) -> Path:
    """The demo llama as llm-compressor's pack-quantized W4A16 checkpoint (groups of 128)."""
    return write_compressed(demo_dirs["llama"], tmp_path_factory.mktemp("w4a16") / "llama", "int4")


@pytest.fixture(scope="module")
def two_ranks(demo_dirs, moe_dirs, kiln_cache, w4a16_llama) -> list[dict]:
    """What each of two ranks generated; the llama's artifact was compiled first by one `kiln compile`."""
    compiled = subprocess.run([sys.executable, "-m", "kiln", "compile", str(demo_dirs["llama"]), "--cache-dir",
                               str(kiln_cache), "--tensor-parallel-size", "2"], capture_output=True, text=True)
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    assert "allreduce_rms" in compiled.stdout
    dirs = {arch: str(d) for arch, d in {**demo_dirs, **moe_dirs}.items()}
    args = [json.dumps(dirs), str(kiln_cache), json.dumps(PROMPTS), ",".join(COMPILED), str(w4a16_llama)]
    return run_ranks(RANK, args, timeout=900)


def test_ranks_agree(two_ranks):
    assert two_ranks[0] == two_ranks[1]  # every rank samples from the same gathered logits
    assert sorted(two_ranks[0]["compiled"]) == sorted(COMPILED)


@pytest.mark.parametrize("arch", DEMO_ARCHS)
def test_two_ranks_generate_what_one_does(two_ranks, demo_dirs, arch):
    one = [o.token_ids for o in LLM(demo_dirs[arch]).generate(PROMPTS, GREEDY)]
    assert two_ranks[0]["eager"][arch] == one
    if arch in COMPILED:
        assert two_ranks[0]["compiled"][arch] == one


@pytest.mark.parametrize("arch", MOE_DEMO_ARCHS)
def test_experts_split_over_two_ranks_generate_what_one_does(two_ranks, moe_dirs, arch):
    """Each rank holds every expert's half of the intermediate dimension; the block's output is summed over
    ranks: in full precision the tokens of one rank. In int8 (each rank quantizing its share as it loads) a
    row-parallel projection's scales are each rank's half-row's, so the prompt's logprobs come near one
    rank's, not equal (measured up to 0.03 apart, as far as int8 is from full precision)."""
    one = LLM(moe_dirs[arch]).generate(PROMPTS, GREEDY)
    assert two_ranks[0]["eager"][arch] == [o.token_ids for o in one]
    scored = [5, 17, 99, 200, 31, 7, 300, 12]
    one_int8 = LLM(moe_dirs[arch], quantization="int8").generate([scored], SamplingParams(max_tokens=1,
                                                                                         prompt_logprobs=0))
    got = two_ranks[0]["eager"][arch + "_int8"]
    assert max(abs(a - b) for a, b in zip(got, one_int8[0].prompt_logprobs[1:])) < 0.1


def test_int8_splits_and_fuses_allreduce_with_norm_and_quant(two_ranks, demo_dirs):
    from kiln.compiler.trace import trace_backbone
    from kiln.config import ParallelConfig
    from kiln.models.config import ModelConfig
    from kiln.weights.loader import load_weights
    from kiln.models.quantization import QuantLinear, quantize_model
    from kiln.models.registry import create_model
    from kiln.passes import PassManager

    assert two_ranks[0]["int8"] == [o.token_ids for o in
                                    LLM(demo_dirs["llama"], quantization="int8").generate(PROMPTS, GREEDY)]
    # rank 0's graph, traced here without a group (every rank traces the same one)
    model = create_model(ModelConfig.from_model_dir(demo_dirs["llama"]), torch.float32,
                         parallel=ParallelConfig(rank=0, world_size=2))
    load_weights(model, demo_dirs["llama"])
    quantize_model(model, "int8")
    for module in model.modules():  # per-token activations, as CUDA's int8 (a CPU's blocked ones Inductor fuses)
        if isinstance(module, QuantLinear):
            module.act_block = 0
    matches = PassManager(tensor_parallel_size=2).run(trace_backbone(model).graph, (1, 2048)).matches
    # rms_quant first makes each norm a norm+quant; allreduce_rms then takes in the all_reduce too
    assert matches["rms_quant"] == matches["allreduce_rms"] == 2 * 4


def test_int4_splits_like_int8(two_ranks, demo_dirs):
    """Quantized while loading, each rank's slices: a row-parallel down_proj keeps its 256 output
    channels, in groups of 32 of its 256 input channels (the same groups as one rank's)."""
    assert two_ranks[0]["int4_groups"] == [256, 8]
    assert two_ranks[0]["int4"] == [o.token_ids for o in
                                    LLM(demo_dirs["llama"], quantization="int4").generate(PROMPTS, GREEDY)]


def test_a_w4a16_checkpoint_splits_over_ranks(two_ranks, w4a16_llama):
    """Each rank reads its slice of the packed codes and grouped scales: a column-parallel projection
    its rows, a row-parallel one its input channels (int32 words of eight codes, a scale per group of
    128), and generates what one rank does."""
    shapes = two_ranks[0]["w4a16_shapes"]
    assert shapes["gate_up_proj"] == [[2 * 256, 256 // 2], [2 * 256, 256 // 128]]  # half of 2 x 512 rows
    assert shapes["o_proj"] == [[256, 128 // 2], [256, 1]]  # 4 of 8 heads of 32: 128 input channels
    assert shapes["down_proj"] == [[256, 256 // 2], [256, 2]]
    assert two_ranks[0]["w4a16"] == [o.token_ids for o in LLM(w4a16_llama).generate(PROMPTS, GREEDY)]


def test_allreduce_rms_fuses_two_sites_per_layer_and_changes_nothing(two_ranks):
    got = two_ranks[0]
    assert got["factors"] == 2 and got["pieces_compiled"] == 0
    assert got["matches"]["allreduce_rms"] == 2 * 4  # the demo llama has 4 layers
    torch.testing.assert_close(torch.tensor(got["fused"]), torch.tensor(got["unfused"]), atol=1e-4, rtol=0)


def test_serve_launches_two_ranks_that_answer_like_one(two_ranks, demo_dirs, kiln_cache, tmp_path):
    port = free_port()
    cmd = [sys.executable, "-m", "kiln", "-v", "serve", str(demo_dirs["llama"]), "--tensor-parallel-size", "2",
           "--port", str(port), "--cache-dir", str(kiln_cache), "--require-artifact"]  # the fixture compiled it
    with serving(cmd, port, tmp_path / "serve.log", timeout=240) as url:
        texts = [httpx.post(f"{url}/v1/completions", json={"model": "llama", "prompt": p, "max_tokens": 8,
                                                           "temperature": 0}).json()["choices"][0]["text"]
                 for p in PROMPTS]
    log = (tmp_path / "serve.log").read_text()
    assert "starting 2 ranks" in log and "rank 1 follows rank 0's engine" in log
    deadline = time.time() + 10
    while processes_with("--port", str(port)) and time.time() < deadline:
        time.sleep(0.2)
    assert processes_with("--port", str(port)) == []  # SIGTERM to `kiln serve` stopped its ranks too
    assert texts == [o.text for o in LLM(demo_dirs["llama"]).generate(PROMPTS, SamplingParams(max_tokens=8,
                                                                                               temperature=0))]
