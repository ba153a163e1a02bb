"""Mixture-of-experts models (Qwen3-MoE, Mixtral) against transformers, the numeric oracle: the fused
MoE op against a dense reference, the models eager and compiled (random weights, tiny shapes), the
checkpoint's per-expert tensors checked, and what MoE does not support yet refused by name."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from kiln import LLM, SamplingParams
from kiln.config import ParallelConfig
from kiln.errors import KilnError
from kiln.models.config import ModelConfig
from kiln.models.demo import MOE_DEMO_ARCHS, write_demo_model
from kiln.models.tensor_parallel import RankLayout

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


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("moe")
    return {arch: write_demo_model(root / arch, arch=arch, num_layers=2, train_steps=0)
            for arch in MOE_DEMO_ARCHS}


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


@pytest.mark.parametrize("arch", MOE_DEMO_ARCHS)
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


def test_what_moe_cannot_do_yet_is_refused_by_name(moe_dirs, tmp_path):
    with pytest.raises(KilnError, match="quantizing Qwen3MoeForCausalLM's experts is not supported yet"):
        LLM(moe_dirs["qwen3_moe"], max_model_len=64, quantization="int8")
    with pytest.raises(KilnError, match="tensor parallelism over MixtralForCausalLM's experts is not supported yet"):
        RankLayout.of(ModelConfig.from_model_dir(moe_dirs["mixtral"]), ParallelConfig(rank=0, world_size=2))
    hf = json.loads((moe_dirs["qwen3_moe"] / "config.json").read_text())
    with pytest.raises(KilnError, match="mlp_only_layers"):
        ModelConfig.from_hf({**hf, "mlp_only_layers": [0]})
    with pytest.raises(KilnError, match="num_experts_per_tok"):
        ModelConfig.from_hf({k: v for k, v in hf.items() if k != "num_experts_per_tok"})
