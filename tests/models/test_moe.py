"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers, the numeric oracle: the fused
MoE op against a dense reference, the models eager and compiled (random weights, tiny shapes), the
checkpoint's per-expert tensors checked, and what MoE does not support yet refused by name."""

import dataclasses
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kiln import LLM, SamplingParams
from kiln.config import ParallelConfig
from kiln.errors import KilnError
from kiln.models.compressed_tensors import CheckpointQuantization
from kiln.models.config import ModelConfig, MoeSpec
from kiln.models.demo import MOE_DEMO_ARCHS
from kiln.models.registry import create_model
from kiln.models.tensor_parallel import RankLayout, Shard

PROMPTS = [[5, 17, 99, 200, 31, 7, 300, 12], [44, 3], [250, 251, 9, 60, 61]]


def _dense_reference(x, logits, w13, w2, top_k, renormalize):
    """Every expert on every token, weighted by the router (zero off its top k): what fused_moe must equal."""
    probs = torch.softmax(logits.float(), -1)
    top, ids = probs.topk(top_k, -1)
    if renormalize:
        top = top / top.sum(-1, keepdim=True)
    weight = torch.zeros_like(probs).scatter(1, ids, top)
    inter = w13.shape[1] // 2
    h = torch.einsum("th,eih->tei", x, w13)
    y = torch.einsum("tei,ehi->teh", F.silu(h[..., :inter]) * h[..., inter:], w2)
    return (y * weight.unsqueeze(-1)).sum(1)


@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_equals_every_expert_weighted_by_the_router(renormalize):
    torch.manual_seed(0)
    tokens, hidden, inter, experts = 11, 16, 8, 6
    x, logits = torch.randn(tokens, hidden), torch.randn(tokens, experts)
    w13, w2 = torch.randn(experts, 2 * inter, hidden) / 4, torch.randn(experts, hidden, inter) / 4
    got = torch.ops.kiln.fused_moe(x, logits, w13, w2, 2, renormalize)
    torch.testing.assert_close(got, _dense_reference(x, logits, w13, w2, 2, renormalize), rtol=1e-5, atol=1e-5)


def test_a_token_reads_only_its_experts_weights():
    """Decode at batch 1 reads top_k experts: the others' weights may be anything, NaN included."""
    torch.manual_seed(1)
    x, logits = torch.randn(1, 16), torch.tensor([[0.0, 5.0, -1.0, 4.0]])
    w13, w2 = torch.randn(4, 16, 16), torch.randn(4, 16, 8)
    poisoned_13, poisoned_2 = w13.clone(), w2.clone()
    for e in (0, 2):
        poisoned_13[e], poisoned_2[e] = float("nan"), float("nan")
    torch.testing.assert_close(torch.ops.kiln.fused_moe(x, logits, poisoned_13, poisoned_2, 2, True),
                               torch.ops.kiln.fused_moe(x, logits, w13, w2, 2, True))


@pytest.mark.parametrize("scheme", ["int8", "q8_0", "int4", "fp8"])
def test_quantized_experts_run_as_their_projections_would(scheme):
    """Experts quantized as stacked projections (a scale per row, so per expert) give what each expert's own
    quantized projection gives on every token, weighted by the router: the op groups tokens, views each
    expert's codes, scales and minimums, and quantizes its activations as the projection does."""
    from kiln.models.config import MoeSpec
    from kiln.models.moe import Experts
    from kiln.models.quantization import quantize_model, quantized_linear

    torch.manual_seed(2)
    tokens, hidden, inter, num = 9, 64, 32, 4
    experts = Experts(MoeSpec(num, 2, inter, True, "mlp", ("gate_proj", "up_proj", "down_proj")), hidden, inter,
                      torch.float32).requires_grad_(False)
    experts.gate_up_proj.weight.normal_(0, 0.2)
    experts.down_proj.weight.normal_(0, 0.2)
    w13 = experts.gate_up_proj.weight.view(num, 2 * inter, hidden).clone()
    w2 = experts.down_proj.weight.view(num, hidden, inter).clone()
    quantize_model(experts, scheme)
    x, logits = torch.randn(tokens, hidden), torch.randn(tokens, num)
    (q13, s13, m13), (q2, s2, m2) = experts.stacked(experts.gate_up_proj), experts.stacked(experts.down_proj)
    got = torch.ops.kiln.fused_moe(x, logits, q13, q2, 2, True, s13, s2, m13, m2)

    def projection(w: torch.Tensor) -> torch.nn.Module:
        linear = torch.nn.Linear(w.shape[1], w.shape[0], bias=False).requires_grad_(False)
        linear.weight.copy_(w)
        return quantized_linear(linear, scheme)

    probs = torch.softmax(logits, -1)
    top, ids = probs.topk(2, -1)
    weight = torch.zeros_like(probs).scatter(1, ids, top / top.sum(-1, keepdim=True))
    want = sum(projection(w2[e])(torch.ops.kiln.silu_and_mul(projection(w13[e])(x))) * weight[:, e:e + 1]
               for e in range(num))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    dense = _dense_reference(x, logits, w13, w2, 2, True)  # and near the full-precision experts
    assert (got - dense).norm() / dense.norm() < (0.2 if scheme == "int4" else 0.05)  # 4 bits: ~0.13 here


def _hf(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _greedy_hf(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()


GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("arch", MOE_DEMO_ARCHS)
def test_eager_moe_matches_transformers(moe_dirs, arch):
    hf, llm = _hf(moe_dirs[arch]), LLM(moe_dirs[arch], max_model_len=256)
    assert ModelConfig.from_model_dir(moe_dirs[arch]).moe is not None
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [_greedy_hf(hf, p, 10) for p in PROMPTS]
    scored = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs[1:]
    with torch.no_grad():
        logprobs = torch.log_softmax(hf(torch.tensor([PROMPTS[0]])).logits[0].float(), -1)
    want = [logprobs[i, t].item() for i, t in enumerate(PROMPTS[0][1:])]
    assert max(abs(a - b) for a, b in zip(scored, want)) < 1e-4


@pytest.mark.parametrize("arch", ["qwen3_moe"])  # Mixtral compiles below, quantized
def test_compiled_moe_matches_transformers(moe_dirs, kiln_cache, arch):
    """Compiled, the MoE layers share one piece (no layer index in the graph) and give transformers' tokens,
    prompts of different lengths batched together."""
    hf = _hf(moe_dirs[arch])
    llm = LLM(moe_dirs[arch], max_model_len=256, compile=True, cache_dir=kiln_cache)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [_greedy_hf(hf, p, 10) for p in PROMPTS]


def test_a_missing_expert_tensor_is_named(moe_dirs, tmp_path):
    model = shutil.copytree(moe_dirs["mixtral"], tmp_path / "m")
    tensors = load_file(model / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, model / "model.safetensors")
    with pytest.raises(KilnError, match=r"missing tensor 'model\.layers\.1\.block_sparse_moe\.experts\.3\.w2\.weight'"):
        LLM(model, max_model_len=64)


@pytest.mark.parametrize("arch", MOE_DEMO_ARCHS)
def test_quantized_experts_stay_near_full_precision(moe_dirs, arch):
    """`--quantization` covers the experts (quantized while loading): prompt logprobs within each scheme's
    error of the full-precision model's (measured: int8 0.02, q8_0 0.03, int4 0.28 at most)."""
    score = SamplingParams(max_tokens=1, prompt_logprobs=0)
    full = LLM(moe_dirs[arch], max_model_len=256).generate([PROMPTS[0]], score)[0].prompt_logprobs[1:]
    for scheme, bound in (("int8", 0.1), ("q8_0", 0.1), ("int4", 0.6)):
        llm = LLM(moe_dirs[arch], max_model_len=256, quantization=scheme)
        experts = getattr(llm.model.model.layers[0], llm.model.model.layers[0].ffn).experts
        assert experts.down_proj.weight.element_size() == 1
        got = llm.generate([PROMPTS[0]], score)[0].prompt_logprobs[1:]
        assert max(abs(a - b) for a, b in zip(got, full)) < bound, scheme


def test_quantized_moe_compiled_equals_eager(moe_dirs, kiln_cache):
    """Mixtral compiled with int8 experts (codes, scales and no minimums passed to the op as graph inputs):
    eager's tokens."""
    eager = LLM(moe_dirs["mixtral"], max_model_len=256, quantization="int8")
    compiled = LLM(moe_dirs["mixtral"], max_model_len=256, quantization="int8", compile=True, cache_dir=kiln_cache)
    want = [o.token_ids for o in eager.generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in compiled.generate(PROMPTS, GREEDY)] == want


def test_experts_split_along_their_intermediate_dimension():
    cfg = ModelConfig(architecture="MixtralForCausalLM", vocab_size=512, hidden_size=256, intermediate_size=96,
                      num_layers=2, num_heads=8, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=1e4,
                      max_position_embeddings=256,
                      moe=MoeSpec(4, 2, 96, True, "block_sparse_moe", ("w1", "w3", "w2")))
    r1 = RankLayout.of(cfg, ParallelConfig(rank=1, world_size=2))
    assert r1.moe_intermediate_size == 48
    experts = "model.layers.0.block_sparse_moe.experts.3"
    assert r1.shard(f"{experts}.w1.weight") == r1.shard(f"{experts}.w3.weight") == Shard(0, 48, 48)
    assert r1.shard(f"{experts}.w2.weight") == Shard(1, 48, 48)
    assert r1.shard("model.layers.0.block_sparse_moe.gate.weight") is None  # the router: every rank's
    with pytest.raises(KilnError, match="the experts' intermediate size 96 is not divisible by the tensor parallel"):
        RankLayout.of(dataclasses.replace(cfg, num_heads=10), ParallelConfig(rank=0, world_size=5))


def test_what_moe_cannot_do_yet_is_refused_by_name(moe_dirs, tmp_path):
    cfg = ModelConfig.from_model_dir(moe_dirs["qwen3_moe"])
    with pytest.raises(KilnError, match="pre-quantized Qwen3MoeForCausalLM checkpoints are not supported yet"):
        create_model(dataclasses.replace(cfg, quantization=CheckpointQuantization("int8", False, False)),
                     torch.float32)
    hf = json.loads((moe_dirs["qwen3_moe"] / "config.json").read_text())
    with pytest.raises(KilnError, match="mlp_only_layers"):
        ModelConfig.from_hf({**hf, "mlp_only_layers": [0]})
    with pytest.raises(KilnError, match="num_experts_per_tok"):
        ModelConfig.from_hf({k: v for k, v in hf.items() if k != "num_experts_per_tok"})


@pytest.mark.parametrize("arch", MOE_DEMO_ARCHS)
def test_under_two_ranks_the_moe_blocks_allreduce_fuses_with_the_next_norm(moe_dirs, arch):
    """Rank 0's graph: one all_reduce after each attention and each MoE block (and the vocabulary-parallel
    embedding's), each block's taken into the RMSNorm after it (the last one's into the final norm)."""
    from kiln.compiler.trace import trace_backbone
    from kiln.passes import PassManager
    from kiln.weights.loader import load_weights

    cfg = ModelConfig.from_model_dir(moe_dirs[arch])
    model = create_model(cfg, torch.float32, parallel=ParallelConfig(rank=0, world_size=2))
    load_weights(model, moe_dirs[arch])
    graph = trace_backbone(model).graph
    reduces = [n for n in graph.graph.nodes if n.target == torch.ops.kiln.all_reduce.default]
    assert len(reduces) == 2 * cfg.num_layers + 1
    assert PassManager(tensor_parallel_size=2).run(graph, (1, 2048)).matches["allreduce_rms"] == 2 * cfg.num_layers
