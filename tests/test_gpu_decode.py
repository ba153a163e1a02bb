"""benchmarks/gpu_decode.py: its bookkeeping on synthetic rounds, its argument checks, and one real run
on the CPU (the demo llama, the session's artifact, a process a system): the smoke test of the script
whose figures come from a GPU."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_decode.py"
spec = importlib.util.spec_from_file_location("gpu_decode", SCRIPT)
gpu_decode = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpu_decode)


def _run(decode: dict, prefill: float, greedy: list) -> dict:
    return {"m": {"decode_ms": decode, "prefill_ms": prefill, "greedy": greedy, "copy_rate_gb_s": 100.0}}


def test_ratios_pair_each_system_with_hf_best_in_its_round():
    # round 1: hf-compiled is HF's best at b1, hf-eager at prefill; round 2 ran slow, and hf-eager missed it
    rounds = [{"hf-eager": _run({"1": 10.0}, 4.0, [[1, 2, 3]]), "hf-compiled": _run({"1": 2.0}, 5.0, [[1, 2, 3]]),
               "kiln-graphs": _run({"1": 1.0}, 2.0, [[1, 9, 3]])},
              {"hf-compiled": _run({"1": 4.0}, 10.0, [[1, 2, 3]]), "kiln-graphs": _run({"1": 1.0}, 4.0, [[1, 2, 3]])}]
    floors = {"m": {"weight_bytes": 10**9, "copy_rate_gb_s": 2000.0, "floor_ms": 0.5}}
    row = gpu_decode.summarize(rounds, {"m": Path("m")}, floors)["m"]["systems"]["kiln-graphs"]
    assert row["decode_ms"] == {"1": 1.0} and row["prefill_ms"] == 3.0 and row["rounds"] == 2
    # b1: 2.0 / 1.0 and 4.0 / 1.0, median 3.0 (not the medians' ratio 3.0 / 1.0 by luck: see prefill);
    # prefill: min(4, 5) / 2 = 2.0 and 10 / 4 = 2.5, median 2.25, where the medians' ratio says 4.5 / 3
    assert row["speedup_vs_hf_best"] == {"b1": 3.0, "prefill": 2.25}
    assert row["floor_fraction"] == {"1": 0.5}
    greedy = gpu_decode.summarize(rounds, {"m": Path("m")}, floors)["m"]["greedy_vs_hf_eager"]
    assert greedy["kiln-graphs"] == {"identical": 0, "prompts": 1, "first_difference": [1]}
    assert greedy["hf-compiled"] == {"identical": 1, "prompts": 1, "first_difference": [None]}


@pytest.mark.parametrize("argv, message", [
    (["--device", "cpu", "--systems", "kiln-graphs"], "kiln-graphs needs CUDA"),
    (["--prefill", "16*512"], "expected BATCHxLENGTH"),
    (["--systems", "vllm"], "unknown systems"),
    (["--models", ""], "no model to run"),
    (["--rounds", "0"], "--rounds must be at least 1"),
])
def test_bad_arguments_are_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit):
        gpu_decode.parse_args(argv)
    assert message in capsys.readouterr().err


def test_cpu_run_times_every_system_and_compares_greedy_tokens(demo_dirs, hf_models, llama_artifact, kiln_cache,
                                                                 tmp_path):
    out = tmp_path / "decode.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--dtype", "float32", "--models", "", "--model-dir",
         str(demo_dirs["llama"]), "--systems", "hf-eager,kiln-eager,kiln-compiled", "--batches", "1,2",
         "--prefill", "2x16", "--steps", "4", "--prompt-len", "16", "--rounds", "1", "--cache-dir", str(kiln_cache),
         "--work", str(tmp_path / "work"), "--out", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    runs = results["rounds"][0]
    assert set(runs) == {"hf-eager", "kiln-eager", "kiln-compiled"}
    for system, run in runs.items():
        run = run["llama"]
        assert "error" not in run, run.get("error")
        assert set(run["decode_ms"]) == {"1", "2"} and all(ms > 0 for ms in run["decode_ms"].values()), system
        assert run["prefill_ms"] > 0 and run["copy_rate_gb_s"] > 0
    assert runs["kiln-compiled"]["llama"]["artifact"] == str(llama_artifact)  # loaded, not compiled again
    summary = results["summary"]["llama"]
    # fp32 on the CPU: kiln's greedy tokens are transformers' own
    for system in ("kiln-eager", "kiln-compiled"):
        assert summary["greedy_vs_hf_eager"][system]["identical"] == 4, summary["greedy_vs_hf_eager"]
    hf = hf_models["llama"]
    tied = hf.config.tie_word_embeddings
    expected = sum(p.numel() * 4 for n, p in hf.named_parameters() if tied or "embed_tokens" not in n)
    assert summary["weight_bytes"] == expected
    kiln_b1, hf_b1 = runs["kiln-eager"]["llama"]["decode_ms"]["1"], runs["hf-eager"]["llama"]["decode_ms"]["1"]
    assert summary["systems"]["kiln-eager"]["speedup_vs_hf_best"]["b1"] == round(hf_b1 / kiln_b1, 3)
    profile = runs["kiln-compiled"]["llama"]["profile"]
    assert "Self CPU" in profile["table"] and profile["step_wall_ms"] > 0 and profile["steps"] == 5
    assert results["goals"]["llama"]["b1_vs_hf_best"] == summary["systems"]["kiln-compiled"]["speedup_vs_hf_best"]["b1"]
