"""benchmarks/peers.py's bookkeeping: rounds in rotated order, medians, and ratios paired within a
round (this machine's memory bandwidth moves by half between minutes, so a system is compared with
what ran beside it)."""

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("peers", Path(__file__).resolve().parents[1] / "benchmarks" / "peers.py")
peers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(peers)


def _sample(ms: float, tok_s: float = 100.0, prefill: float = 1.0, start: float = 3.0) -> dict:
    return {"start_s": start, "prefill_s": prefill, "batch16_tok_s": tok_s, "batch1_ms_per_token": ms, "tokens": []}


def test_each_round_starts_one_system_later():
    systems = ["a", "b", "c"]
    assert [peers.rotated(systems, i) for i in range(4)] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"],
                                                             ["a", "b", "c"]]


def test_ratios_are_paired_within_rounds_then_the_median():
    # kiln is 0.5x vllm in the fast and the slow round; in the third vllm hit a slow minute alone. The
    # paired ratio stays 0.5, where the ratio of the medians (8 / 24) would claim 0.33
    rounds = [{"kiln": _sample(5.0), "vllm": _sample(10.0)},
              {"kiln": _sample(12.0), "vllm": _sample(24.0)},
              {"kiln": _sample(8.0), "vllm": _sample(30.0)}]
    assert peers.ratios(rounds)["vs_vllm"]["kiln"]["batch1_ms_per_token"] == 0.5
    # the table's figures: each one's median over the rounds
    assert peers.summary(rounds)["kiln"]["batch1_ms_per_token"] == 8.0
    assert peers.summary(rounds)["vllm"]["batch1_ms_per_token"] == 24.0


def test_a_system_without_a_figure_gets_no_ratio_for_it():
    """llama.cpp's runs have no start time and no tokens: their other ratios stand."""
    rounds = [{"kiln": _sample(10.0), "llama.cpp-q8_0": {"prefill_s": 2.0, "batch16_tok_s": 50.0,
                                                          "batch1_ms_per_token": 20.0}}]
    got = peers.ratios(rounds)["vs_llama.cpp-q8_0"]["kiln"]
    assert got == {"start": None, "batch1_ms_per_token": 0.5, "batch16_tok_s": 2.0, "prefill": 0.5}


def test_llama_batched_bench_figures_and_gguf_names():
    table = """
|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    32 |     64 |    1 |     96 |    0.083 |   385.39 |    1.600 |    40.00 |    1.683 |    57.03 |
|    32 |     64 |   16 |   1536 |    2.100 |   243.81 |    8.192 |   125.00 |   10.29 |   149.20 |
"""
    import llama_cpp_peer  # on the path since peers.py was loaded

    assert llama_cpp_peer.figures(table, 16, 64) == {"prefill_s": 2.1, "batch16_tok_s": 125.0,
                                                     "batch1_ms_per_token": 25.0}
    assert llama_cpp_peer.gguf_name("model.layers.3.self_attn.k_proj.bias") == "blk.3.attn_k.bias"
    assert llama_cpp_peer.gguf_name("model.layers.0.mlp.down_proj.weight") == "blk.0.ffn_down.weight"
    assert llama_cpp_peer.gguf_name("model.embed_tokens.weight") == "token_embd.weight"


def test_depth_figures_from_llama_bench_and_their_ratios():
    """`--depth`: llama-bench's JSON records (a prompt-only test has n_gen 0) become ms per token at each
    depth, and each depth's ratio is paired within its round like the other figures."""
    import llama_cpp_peer

    runs = [{"n_prompt": 0, "n_gen": 32, "n_depth": 2048, "avg_ts": 12.5},
            {"n_prompt": 0, "n_gen": 32, "n_depth": 8192, "avg_ts": 8.0},
            {"n_prompt": 512, "n_gen": 0, "n_depth": 2048, "avg_ts": 300.0}]
    llama = llama_cpp_peer.depth_figures(runs, [2048, 8192], 32)
    assert llama == {"b1_ms_per_token_at_2048": 80.0, "b1_ms_per_token_at_8192": 125.0}
    with pytest.raises(RuntimeError, match=r"reported depths \[2048, 8192\], asked for \[32, 2048\]"):
        llama_cpp_peer.depth_figures(runs, [32, 2048], 32)
    prefills = [{"n_prompt": 2048, "n_gen": 0, "n_depth": 0, "avg_ts": 400.0},
                {"n_prompt": 8192, "n_gen": 0, "n_depth": 0, "avg_ts": 256.0}]
    llama |= llama_cpp_peer.prefill_figures(prefills + runs, [2048, 8192])  # a prefill at depth is not one
    assert llama["prefill_s_of_2048"] == 5.12 and llama["prefill_s_of_8192"] == 32.0
    with pytest.raises(RuntimeError, match=r"reported prompts of \[2048, 8192\], asked for \[512\]"):
        llama_cpp_peer.prefill_figures(prefills, [512])
    rounds = [{"kiln-fp32": {"b1_ms_per_token_at_2048": 60.0, "b1_ms_per_token_at_8192": 100.0,
                             "prefill_s_of_2048": 2.56, "prefill_s_of_8192": 16.0},
               "llama.cpp-f32": llama}]
    figures = peers.depth_figures([32, 2048, 8192])  # a prefill is timed from 512 tokens on
    assert peers.ratios(rounds, figures)["vs_llama.cpp-f32"]["kiln-fp32"] == {
        "batch1_ms_per_token_at_32": None, "batch1_ms_per_token_at_2048": 0.75, "batch1_ms_per_token_at_8192": 0.8,
        "prefill_s_of_2048": 0.5, "prefill_s_of_8192": 0.5}
    assert llama_cpp_peer.kv_cache_flags("int8") == ["-ctk", "q8_0", "-ctv", "q8_0"]
    assert peers.kv_runs(["hf", "kiln-int8", "llama.cpp-q8_0"], ["auto", "int8"]) == {
        "hf": ("hf", "auto"), "kiln-int8": ("kiln-int8", "auto"), "kiln-int8+kv8": ("kiln-int8", "int8"),
        "llama.cpp-q8_0": ("llama.cpp-q8_0", "auto"), "llama.cpp-q8_0+kv8": ("llama.cpp-q8_0", "int8")}
    kv8 = {"kiln-int8+kv8": {"prefill_s_of_2048": 3.0}, "llama.cpp-q8_0+kv8": {"prefill_s_of_2048": 6.0}}
    assert peers.ratios([kv8], {"prefill": "prefill_s_of_2048"}) == {  # a +kv8 peer is a reference too
        "vs_llama.cpp-q8_0+kv8": {"kiln-int8+kv8": {"prefill": 0.5}}}
    assert llama_cpp_peer.kv_cache_flags("auto") == []
