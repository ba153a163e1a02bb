"""Config variants the demo models do not cover, against transformers on the same weights."""

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kiln import LLM, SamplingParams
from tests.oracle import hf_greedy


def test_llama_with_attention_and_mlp_bias_and_no_tokenizer(tmp_path):
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, attention_bias=True, mlp_bias=True,
                      rope_scaling=dict(rope_type="linear", factor=2.0), initializer_range=0.1)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    for p in hf.parameters():  # transformers zero-initializes biases; make them count
        p.data.add_(torch.randn_like(p) * 0.05)
    hf.save_pretrained(tmp_path)
    prompt = [5, 17, 3, 88, 42, 42, 9]
    ref_tokens, ref_logprobs = hf_greedy(hf, prompt, 12)
    llm = LLM(tmp_path)
    assert llm.tokenizer is None and llm.model.model.layers[0].mlp.down_proj.bias is not None
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0))[0]
    assert out.token_ids == ref_tokens and out.text == ""
    torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(ref_logprobs), atol=1e-4, rtol=0)
