"""benchmarks/quality.py: llama-perplexity's protocol (windows, the half each is scored on, its final
estimate read back), greedy agreement, and, where `python benchmarks/smollm2.py` has fetched the real
model, the gate that kiln in full precision is transformers on it: the same greedy tokens and the
same perplexity."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
spec = importlib.util.spec_from_file_location("quality", BENCHMARKS / "quality.py")
quality = importlib.util.module_from_spec(spec)
spec.loader.exec_module(quality)
import smollm2  # noqa: E402  (benchmarks/, on the path quality.py puts it)

LLAMA_PERPLEXITY_TAIL = """perplexity: tokenizing the input ..
perplexity: tokenization took 6.1 ms
perplexity: calculating perplexity over 33 chunks, n_ctx=256, batch_size=256, n_seq=1
perplexity: 0.11 seconds per pass - ETA 0.05 minutes
[1]14.1083,[2]17.5501,[3]19.0130,
Final estimate: PPL = 20.8241 +/- 0.51234
"""


def test_windows_are_consecutive_and_drop_the_tail():
    tokens = list(range(600))
    assert quality.windows(tokens, 256) == [tokens[:256], tokens[256:512]]
    assert quality.windows(tokens, 256, limit=1) == [tokens[:256]]


def test_a_window_is_scored_on_its_second_half():
    # token i's logprob is -i/1000: the scored ones are tokens 129..255, each given all before it
    prompt_logprobs = [None, *(-i / 1000 for i in range(1, 256))]
    scored = quality.scored_logprobs(prompt_logprobs, 256)
    assert len(scored) == 127 and scored[0] == -0.129 and scored[-1] == -0.255
    assert quality.perplexity([math.log(0.5)] * 4) == pytest.approx(2.0)


def test_llama_perplexity_output_is_read():
    assert quality.parse_llama_perplexity(LLAMA_PERPLEXITY_TAIL) == {"perplexity": 20.8241, "windows": 33}
    with pytest.raises(RuntimeError, match="no final estimate"):
        quality.parse_llama_perplexity("perplexity: calculating perplexity over 33 chunks\n[1]14.1,")


def test_each_family_is_compared_with_its_own_full_precision():
    runs = {"kiln-fp32": {"logprobs": [math.log(0.05)] * 2, "greedy": [[1, 2, 3], [4, 5]]},
            "kiln-int8": {"logprobs": [math.log(0.04)] * 2, "greedy": [[1, 2, 3], [4, 6]]},
            "llama.cpp-f32": {"perplexity": 20.0, "windows": 33},
            "llama.cpp-q8_0": {"perplexity": 21.0, "windows": 33}}
    table = quality.summarize(runs)
    assert table["kiln-int8"]["perplexity"] == 25.0 and table["kiln-int8"]["vs_full_precision"] == 0.25
    assert table["kiln-int8"]["greedy_vs_kiln_fp32"] == {"identical": 1, "prompts": 2,
                                                         "mean_tokens_before_difference": 2.0}
    assert table["llama.cpp-q8_0"]["vs_full_precision"] == 0.05 and "vs_full_precision" not in table["kiln-fp32"]


@pytest.fixture(scope="module")
def real_model() -> Path:
    model = smollm2.model_dir()
    if model is None:
        pytest.skip("the real model is not fetched: run `python benchmarks/smollm2.py` (registry access) first")
    return model


def test_kiln_is_transformers_on_the_real_model(real_model, tmp_path):
    from kiln.runtime.tokenizer import Tokenizer

    tokenizer = Tokenizer(real_model)
    chunks = quality.windows(tokenizer.encode(quality.TEXT.read_text()), 256, limit=3)
    prompts = [tokenizer.encode(p) for p in quality.PROMPTS]
    hf = quality.hf_run(real_model, chunks, prompts, 256)
    kiln = quality.kiln_run("kiln-eager", real_model, chunks, prompts, 256, tmp_path, threads=None)
    assert kiln["greedy"] == hf["greedy"]
    assert tokenizer.decode(kiln["greedy"][0]).startswith(" Paris")
    assert len(kiln["logprobs"]) == len(hf["logprobs"]) == 3 * 127
    assert quality.perplexity(kiln["logprobs"]) == pytest.approx(quality.perplexity(hf["logprobs"]), rel=1e-5)
