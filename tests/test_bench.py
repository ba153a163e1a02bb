"""`kiln bench startup`: the summary, the checks and the chart on synthetic results. The real run (a cold
compile, a warm one, an artifact and an eager first token) is CI's benchmark step in `.ci/run`, which fails
on its checks; the suite does not run it a second time."""

import argparse
import json
import statistics
import sys

import pytest
import torch

from kiln.bench import startup
from kiln.errors import KilnError

IDLE = {"graphs_traced": 0, "pieces_compiled": 0}
COLD = {"graphs_traced": 1, "pieces_compiled": 3, "blobs_saved": 3}
LOADED = {"graphs_traced": 0, "pieces_compiled": 0, "blobs_loaded": 3}


def parse(*argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    startup.add_arguments(parser)
    return parser.parse_args([str(a) for a in argv])


def mode(seconds: list[float], counters: dict) -> dict:
    return startup.summarize([startup.Sample(s, dict(counters)) for s in seconds])


def synthetic(artifact_s: float = 4.0, eager_s: float = 4.0, cold=COLD, warm=IDLE, artifact=LOADED) -> dict:
    """A result shaped as `measure` returns it, three runs per mode."""
    modes = {
        "cold_compile": mode([30.0, 33.0, 31.0], cold),
        "warm_compile": mode([3.0, 3.2, 3.1], warm),
        "artifact_first_token": mode([artifact_s * 0.9, artifact_s, artifact_s * 1.2], artifact),
        "eager_first_token": mode([eager_s, eager_s * 1.1, eager_s * 0.95], IDLE),
    }
    return {"model": "/models/demo", "dtype": "float32", "repetitions": 3, "artifact": {"blobs": 3},
            "modes": modes, "artifact_over_eager": round(artifact_s / eager_s, 3)}


def test_summary_is_median_and_min_max_of_the_samples_in_order():
    counters = [{"graphs_traced": i} for i in range(4)]
    summary = startup.summarize([startup.Sample(s, c) for s, c in zip([3.0, 1.0, 2.5, 10.0], counters)])
    assert summary["samples_s"] == [3.0, 1.0, 2.5, 10.0]
    assert (summary["median_s"], summary["min_s"], summary["max_s"]) == (2.75, 1.0, 10.0)
    assert summary["counters"] == counters
    one = startup.summarize([startup.Sample(4.2, {})])
    assert one["median_s"] == one["min_s"] == one["max_s"] == 4.2
    with pytest.raises(ValueError, match="no samples"):
        startup.summarize([])


def test_checks_pass_on_a_good_result():
    checks = startup.check(synthetic(artifact_s=5.0, eager_s=4.0), max_artifact_ratio=1.5)
    assert startup.failed(checks) == []
    assert all(c["passed"] is True for c in checks.values())
    assert checks["artifact_over_eager"]["value"] == 1.25 and checks["artifact_over_eager"]["limit"] == 1.5


def test_artifact_at_1_6x_eager_fails_the_ratio_check():
    checks = startup.check(synthetic(artifact_s=6.4, eager_s=4.0), max_artifact_ratio=1.5)
    assert startup.failed(checks) == ["artifact_over_eager"]
    assert "1.60x" in checks["artifact_over_eager"]["detail"] and "1.5x" in checks["artifact_over_eager"]["detail"]


def test_ratio_check_reads_the_ratio_not_seconds():
    fast, slow = synthetic(artifact_s=0.64, eager_s=0.4), synthetic(artifact_s=64.0, eager_s=40.0)
    for result in (fast, slow):
        assert startup.failed(startup.check(result, 1.5)) == ["artifact_over_eager"]
        assert startup.failed(startup.check(result, 1.7)) == []


def test_without_a_limit_the_ratio_is_reported_not_checked():
    checks = startup.check(synthetic(artifact_s=40.0, eager_s=4.0), max_artifact_ratio=None)
    assert checks["artifact_over_eager"]["passed"] is None and checks["artifact_over_eager"]["value"] == 10.0
    assert startup.failed(checks) == []


def test_a_warm_compile_that_compiled_fails():
    checks = startup.check(synthetic(warm={"graphs_traced": 1, "pieces_compiled": 3}), max_artifact_ratio=1.5)
    assert startup.failed(checks) == ["warm_compile_compiles_nothing"]
    assert "run 1" in checks["warm_compile_compiles_nothing"]["detail"]


@pytest.mark.parametrize("counters", [{"graphs_traced": 0, "pieces_compiled": 1, "blobs_loaded": 3},
                                      {"graphs_traced": 0, "pieces_compiled": 0}],  # no blobs: not the artifact
                         ids=["compiled", "loaded-nothing"])
def test_an_artifact_run_that_compiled_or_loaded_nothing_fails(counters):
    checks = startup.check(synthetic(artifact=counters), max_artifact_ratio=1.5)
    assert startup.failed(checks) == ["artifact_load_compiles_nothing"]


def test_a_cold_compile_that_compiled_nothing_fails():
    checks = startup.check(synthetic(cold=IDLE), max_artifact_ratio=None)
    assert startup.failed(checks) == ["cold_compile_compiles"]


@pytest.mark.parametrize("artifact_s, status", [(5.0, 0), (6.4, 1)], ids=["pass", "ratio-fails"])
def test_run_prints_json_writes_out_and_sets_the_exit_status(artifact_s, status, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(startup, "measure", lambda *a, **k: synthetic(artifact_s=artifact_s, eager_s=4.0))
    (tmp_path / "config.json").write_text("{}")
    out = tmp_path / "result.json"
    assert startup.run(parse(tmp_path, "--max-artifact-ratio", "1.5", "--out", out)) == status
    printed = capsys.readouterr()
    result = json.loads(printed.out)
    assert json.loads(out.read_text()) == result
    assert result["passed"] is (status == 0) and set(result["checks"]) == {
        "cold_compile_compiles", "warm_compile_compiles_nothing", "artifact_load_compiles_nothing",
        "artifact_over_eager"}
    assert ("check artifact_over_eager FAILED" in printed.err) is (status == 1)


def test_bad_input_is_refused_before_measuring(tmp_path, monkeypatch):
    def measure(*args, **kwargs):
        raise AssertionError("measured although the input was unusable")

    monkeypatch.setattr(startup, "measure", measure)
    with pytest.raises(KilnError, match="no config.json"):
        startup.run(parse(tmp_path / "missing"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(KilnError, match="does not exist"):
        startup.run(parse(tmp_path, "--out", tmp_path / "no-such-dir" / "r.json"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(KilnError, match="pip install matplotlib"):
        startup.run(parse(tmp_path, "--chart", tmp_path / "c.png"))
    for bad in (["--repeats", "0"], ["--max-artifact-ratio", "0"], ["--max-artifact-ratio", "x"]):
        with pytest.raises(SystemExit):
            parse(tmp_path, *bad)


def test_chart_is_a_png_of_the_medians(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    path = tmp_path / "startup.png"
    startup.write_chart(synthetic(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert imread(path).shape[:2] == (576, 960)  # 8 x 4.8 inches at 120 dpi


def test_bench_decode_reports_each_depth_and_batch_against_the_bandwidth_floor(demo_dirs, tmp_path, capsys):
    from kiln.cli import main
    from kiln.models.config import ModelConfig

    out = tmp_path / "decode.json"
    assert main(["bench", "decode", str(demo_dirs["llama"]), "--batches", "1,3", "--steps", "3", "--out", str(out),
                 "--threads", "1", "--rounds", "2", "--depth", "8,300"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report == json.loads(out.read_text())
    assert set(report["depths"]) == {"8", "300"} and report["threads"] == 1 and report["compiled"] is False
    cfg = ModelConfig.from_model_dir(demo_dirs["llama"])  # K and V of every layer, fp32
    assert report["kv_bytes_per_token"] == cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 4
    rounds = report["rounds"]
    assert len(rounds) == 2
    for depth, batches in report["depths"].items():
        assert set(batches) == {"1", "3"}
        for batch, row in batches.items():
            # a step reads the weights and each sequence's KV cache, D + 2 tokens on average over the 3 timed steps
            kv = int(batch) * report["kv_bytes_per_token"] * (int(depth) + 2)
            assert row["bytes_per_step"] == report["weight_bytes_per_step"] + kv
            assert row["tokens_per_s"] == pytest.approx(int(batch) / row["ms_per_token"] * 1e3, rel=1e-2)
            assert row["ms_per_token"] == pytest.approx(
                statistics.median(r["ms_per_token"][depth][batch] for r in rounds), abs=1e-3)
            # each round's fraction pairs its own bandwidth reading with its own time; the report takes the median
            for r in rounds:
                floor_ms = row["bytes_per_step"] / (r["read_bandwidth_gb_s"][depth][batch] * 1e9) * 1e3
                # rel for the rounded inputs, abs for the fraction's own rounding to 3 places (a slow step's ~0.04)
                assert r["floor_fraction"][depth][batch] == pytest.approx(
                    floor_ms / r["ms_per_token"][depth][batch], rel=1e-2, abs=6e-4)
            assert row["floor_fraction"] == pytest.approx(
                statistics.median(r["floor_fraction"][depth][batch] for r in rounds), abs=1e-3)
    assert report["floor_ms_per_step"] == pytest.approx(
        report["weight_bytes_per_step"] / (report["read_bandwidth_gb_s"] * 1e9) * 1e3, rel=1e-2)
    by = rounds[0]["read_bandwidth_by"]["8"]["1"]  # the floor takes the faster read: a sum's, or the int8 panel GEMM's
    assert "sum" in by and rounds[0]["read_bandwidth_gb_s"]["8"]["1"] == pytest.approx(max(by.values()), abs=0.01)
    from kiln.kernels import panel_linear
    assert ("gemv" in by) == (panel_linear.available((4096, 4096), torch.int8) is None)


def test_decode_steps_are_timed_only_when_every_sequence_decodes_alone(demo_dirs):
    """A prompt longer than the step's token budget prefills in chunks: those steps are not decode steps."""
    from kiln import LLM
    from kiln.bench.decode import decode_step_seconds

    llm = LLM(demo_dirs["llama"], max_num_batched_tokens=64, threads=1)
    steps = []
    step = llm.engine.step

    def counted():
        outputs = step()
        steps.append(llm.engine.step_tokens)
        return outputs

    llm.engine.step = counted
    assert decode_step_seconds(llm, 2, 3, prompt_len=100) > 0
    assert steps.count(2) == 3 and len(steps) > 5  # 200 prompt tokens took several 64-token steps first


@pytest.mark.parametrize("option", ["--steps", "--rounds"])
def test_bench_decode_refuses_counts_below_one_by_name(demo_dirs, option, capsys):
    from kiln.cli import main

    assert main(["bench", "decode", str(demo_dirs["llama"]), option, "0"]) != 0
    assert f"{option} must be at least 1, got 0" in capsys.readouterr().err


def test_bench_decode_refuses_a_depth_the_model_cannot_hold(demo_dirs, capsys):
    from kiln.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "decode", str(demo_dirs["llama"]), "--depth", "0"])
    assert "depths must be at least 1 token" in capsys.readouterr().err
    assert main(["bench", "decode", str(demo_dirs["llama"]), "--depth", "1000000", "--threads", "1"]) != 0
    assert "--depth 1000000 and --steps 32 make sequences of" in capsys.readouterr().err


def test_decode_weight_bytes_count_the_head_once_and_no_embedding_lookup(demo_dirs):
    from kiln import LLM
    from kiln.bench.decode import decode_weight_bytes

    for arch in ("llama", "qwen2"):  # untied and tied embeddings
        model = LLM(demo_dirs[arch]).model
        params = dict(model.named_parameters())
        expected = sum(p.numel() * p.element_size() for n, p in params.items() if n != "model.embed_tokens.weight")
        if model.config.tie_word_embeddings:
            expected += params["model.embed_tokens.weight"].numel() * 4
        assert decode_weight_bytes(model) == expected
    int8 = LLM(demo_dirs["llama"], lm_head_quantization="int8").model
    head = int8.lm_head_weight()
    assert decode_weight_bytes(int8) == expected_int8(int8, head)
    full = LLM(demo_dirs["llama"]).model  # greedy steps through the screen read its int8 copy of the head
    assert decode_weight_bytes(full, screened=True) == expected_int8(full, full.lm_head_weight())


def test_decode_weight_bytes_count_a_tokens_top_k_experts(moe_dirs):
    """Mixtral's demo: 4 experts, top 2 (int8: codes and a scale a row, all per expert)."""
    from kiln import LLM
    from kiln.bench.decode import decode_weight_bytes
    from kiln.models.moe import SparseMoeBlock

    for quantization in (None, "int8"):
        model = LLM(moe_dirs["mixtral"], quantization=quantization).model
        assert {(b.top_k, b.experts.num) for b in model.modules() if isinstance(b, SparseMoeBlock)} == {(2, 4)}
        params = dict(model.named_parameters())
        size = {n: p.numel() * p.element_size() for n, p in params.items() if n != "model.embed_tokens.weight"}
        experts = sum(b for n, b in size.items() if ".experts." in n)
        assert decode_weight_bytes(model) == sum(size.values()) - experts // 2


def expected_int8(model, head):
    rest = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
               if n not in ("model.embed_tokens.weight", "lm_head.weight"))
    return rest + head.numel() + head.shape[0] * 4
