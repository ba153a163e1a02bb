"""The artifact: served with no compiler reachable, checked on load, written atomically, keyed right."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kiln import LLM, KilnError, SamplingParams
from kiln.cli import main
from kiln.compiler import artifact
from kiln.compiler.counters import counters
from kiln.compiler.key import cache_key, key_factors
from kiln.config import CompileConfig
from kiln.models.config import ModelConfig
from kiln.passes.gemm_choice import measured_tokens
from kiln.runtime import bind
from tests.oracle import PROMPTS
from tests.processes import bare_env

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0)


SERVE_FROM_ARTIFACT = """
import json, sys
import torch._dynamo.utils
from kiln import LLM, SamplingParams
from kiln.compiler.counters import counters
llm = LLM(sys.argv[1], compile=True, cache_dir=sys.argv[2], require_artifact=True)
outs = llm.generate(json.loads(sys.argv[3]), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=0))
print(json.dumps({
    "token_ids": [o.token_ids for o in outs],
    "logprobs": [o.logprobs for o in outs],
    "dynamo_frames": dict(torch._dynamo.utils.counters["frames"]),
    "inductor_compiler": sorted(m for m in ("torch._inductor.compile_fx", "torch._inductor.codecache",
                                            "torch._inductor.select_algorithm", "torch._inductor.graph")
                                if m in sys.modules),
    "kiln": dict(counters),
    "compiler_modules": sorted(m for m in sys.modules if m.startswith("kiln.compiler")),
}))
"""


def test_serves_from_artifact_with_no_compiler(tmp_path, demo_dirs, kiln_cache, llama_artifact):
    assert shutil.which("g++") or shutil.which("c++")  # the host has one: hiding it is what this test proves
    env = bare_env(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", SERVE_FROM_ARTIFACT, str(demo_dirs["llama"]), str(kiln_cache), json.dumps(PROMPTS)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["dynamo_frames"] == {}  # Dynamo traced nothing
    assert got["inductor_compiler"] == []  # Inductor's Python was never imported, let alone run
    assert got["kiln"] == {"blobs_loaded": 4}  # three unique pieces, the decode attention library
    assert "kiln.compiler.trace" not in got["compiler_modules"] and "kiln.compiler.compile" not in got["compiler_modules"]
    assert not list((tmp_path / "tmp").iterdir())  # nothing was built in a temp dir
    eager = LLM(demo_dirs["llama"]).generate(PROMPTS, GREEDY)
    for ids, logprobs, e in zip(got["token_ids"], got["logprobs"], eager):
        assert ids == e.token_ids
        torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(e.logprobs), atol=1e-4, rtol=0)


def _blob(path: Path) -> Path:
    return sorted((path / "blobs").glob("*.so"))[0]


def _truncate(path: Path) -> None:
    blob = _blob(path)
    blob.write_bytes(blob.read_bytes()[:-100])


def _flip(path: Path) -> None:
    blob = _blob(path)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0xFF
    blob.write_bytes(bytes(data))


def _delete(path: Path) -> None:
    _blob(path).unlink()


def _other_torch(path: Path) -> None:
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["factors"]["torch"] = "2.11.0+cu128"
    artifact.write_manifest(path, manifest)


def _bad_calls(path: Path) -> None:
    calls = sorted((path / "blobs").glob("*.json"))[0]
    calls.write_bytes(b"\0" * calls.stat().st_size)


DAMAGE = {
    "truncated blob": (_truncate, r"artifact blob \S+ is truncated or altered"),
    "flipped byte": (_flip, r"artifact blob \S+ is corrupt \(sha256 mismatch\)"),
    "deleted blob": (_delete, r"artifact blob \S+ is missing"),
    "other torch": (_other_torch, r"artifact built with torch 2\.11\.0\+cu128, this is"),
    "damaged call table": (_bad_calls, r"artifact blob call table \S+\.json is corrupt"),
}


def _copy(llama_artifact: Path, tmp_path: Path) -> Path:
    cache = tmp_path / "cache"
    shutil.copytree(llama_artifact, cache / llama_artifact.name)
    return cache


def test_pieces_calling_kiln_ops_ship_their_call_tables(packed_artifact):
    """AOTInductor's proxy executor reads each op call of a piece from a table beside its library:
    every piece that calls one (here fbgemm's packed int8 GEMM) has its table, recorded with its bytes."""
    manifest = artifact.read_manifest(packed_artifact)
    entries = [e for v in manifest["variants"] for p in v["pieces"].values() for e in p["sizes"].values()]
    calls = {e["sha256"]: e["calls"]["bytes"] for e in entries if e["calls"] is not None}
    assert calls == {p.stem: p.stat().st_size for p in (packed_artifact / "blobs").glob("*.json")} and len(calls) >= 2


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_artifact_names_its_cause(tmp_path, demo_dirs, llama_artifact, packed_artifact, damage, capsys):
    tables = damage == "damaged call table"
    source = packed_artifact if tables else llama_artifact  # only it has call tables (an int8 one)
    quantization = ["--quantization", "w7a8"] if tables else []
    cache = _copy(source, tmp_path)
    hurt, message = DAMAGE[damage]
    hurt(cache / source.name)
    with pytest.raises(artifact.ArtifactError, match="run `kiln compile` again") as err:
        LLM(demo_dirs["llama"], compile=True, cache_dir=cache, require_artifact=True,
            quantization="w7a8" if tables else None)
    assert re.search(message, str(err.value))
    assert not any(re.search(m, str(err.value)) for d, (_, m) in DAMAGE.items() if d != damage)  # one cause each
    argv = ["generate", str(demo_dirs["llama"]), "--prompt", "x", "--require-artifact", "--cache-dir", str(cache),
            *quantization]
    assert main(argv) == 1
    assert re.search(message, capsys.readouterr().err)


def test_damaged_artifact_is_recompiled_by_default(tmp_path, demo_dirs, llama_artifact, caplog):
    cache = _copy(llama_artifact, tmp_path)
    _flip(cache / llama_artifact.name)
    counters.clear()
    llm = LLM(demo_dirs["llama"], compile=True, cache_dir=cache)
    assert "is corrupt" in caplog.text and counters["graphs_traced"] == 1
    artifact.verify(cache / llama_artifact.name)  # repaired in place
    assert llm.generate(["The kiln"], GREEDY)[0].token_ids == LLM(demo_dirs["llama"]).generate(
        ["The kiln"], GREEDY
    )[0].token_ids


@pytest.mark.parametrize("compile", [True, False])  # requiring the artifact runs it, as --require-artifact does
def test_missing_artifact_with_require_artifact_fails(tmp_path, demo_dirs, compile):
    with pytest.raises(artifact.ArtifactMissing, match="run `kiln compile MODEL_DIR`"):
        LLM(demo_dirs["llama"], compile=compile, cache_dir=tmp_path, require_artifact=True)


def test_concurrent_compiles_leave_one_artifact(tmp_path, demo_dirs, llama_artifact):
    """Two processes compile one model into one cache (its pieces come from the run's piece cache: the race is
    over the artifact, not the compile)."""
    cache = tmp_path / "cache"
    cmd = [sys.executable, "-m", "kiln", "compile", str(demo_dirs["llama"]), "--cache-dir", str(cache), "-q"]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    results = [(p.wait(timeout=600), p.stdout.read(), p.stderr.read()) for p in procs]
    assert all(rc == 0 for rc, _, _ in results), "\n".join(err[-4000:] for rc, _, err in results if rc)  # whole
    paths = {out.strip().splitlines()[-1] for _, out, _ in results}
    assert len(paths) == 1
    assert sum("already present" in out for _, out, _ in results) == 1  # one compiled, the other waited and reused
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == [Path(paths.pop()).name]


KILLED_IN_SAVE = """
import sys, time
from pathlib import Path
from kiln.compiler import artifact
write = artifact._write_file
def stall(path, data):
    digest = write(path, data)
    Path(sys.argv[2]).touch()
    time.sleep(600)
    return digest
artifact._write_file = stall
from kiln.cli import main
main(["compile", sys.argv[1], "--cache-dir", sys.argv[3], "-q"])
"""


def test_sigkill_mid_save_leaves_no_artifact(tmp_path, demo_dirs):
    cache, marker = tmp_path / "cache", tmp_path / "saving"
    proc = subprocess.Popen([sys.executable, "-c", KILLED_IN_SAVE, str(demo_dirs["llama"]), str(marker), str(cache)])
    try:
        deadline = time.monotonic() + 300
        while not marker.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        assert any(p.name.startswith(".tmp-") for p in cache.iterdir())  # killed with a half-written artifact
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    key_dirs = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert key_dirs == []
    assert main(["compile", str(demo_dirs["llama"]), "--cache-dir", str(cache), "-q"]) == 0
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == [
        p.name for p in cache.iterdir() if not p.name.startswith(".")
    ]  # the next compile cleaned up the debris
    (artifact_dir,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    artifact.verify(artifact_dir)


def _key(model_dir, dtype=torch.float32, **compile_options) -> str:
    return cache_key(key_factors(ModelConfig.from_model_dir(model_dir), dtype, CompileConfig(**compile_options)))


def test_key_covers_what_changes_code_and_not_weights(tmp_path, demo_dirs):
    from kiln.models.demo import write_demo_model

    base = _key(demo_dirs["llama"])
    assert _key(write_demo_model(tmp_path / "reseeded", arch="llama", seed=7, train_steps=0)) == base  # other weights, same key
    assert _key(write_demo_model(tmp_path / "deeper", arch="llama", num_layers=5, train_steps=0)) != base
    assert _key(demo_dirs["llama"], dtype=torch.bfloat16) != base
    assert _key(demo_dirs["llama"], sizes=(1, 2)) != base
    assert _key(demo_dirs["llama"], max_num_tokens=512) != base
    assert len({base, *(_key(demo_dirs[a]) for a in ("mistral", "qwen2", "qwen3"))}) == 4


def test_an_artifact_and_its_rewritten_files_are_readable_to_others_as_the_umask_allows(llama_artifact, tmp_path):
    """tempfile makes 0700 folders and 0600 files: a cache shared by several users needs the usual modes."""
    from kiln.compiler import atomic

    umask = os.umask(0o022)
    os.umask(umask)
    assert llama_artifact.stat().st_mode & 0o777 == 0o777 & ~umask
    atomic.write_bytes(tmp_path / "f", b"x")
    assert (tmp_path / "f").stat().st_mode & 0o777 == 0o666 & ~umask
    pieces = Path(os.environ["KILN_PIECE_CACHE"])
    assert {p.stat().st_mode & 0o777 for p in pieces.iterdir() if p.is_dir()} == {0o777 & ~umask}


def test_manifest_records_factors_contract_and_timings(llama_artifact):
    manifest = json.loads((llama_artifact / "manifest.json").read_text())
    assert manifest["key"] == llama_artifact.name == cache_key(manifest["factors"])
    assert manifest["factors"]["model"]["num_layers"] == 4 and manifest["factors"]["dtype"] == "float32"
    assert manifest["factors"]["system"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert set(manifest["timings"]) == {"trace", "gemm_choice", "passes", "split", "compile"}
    # every kiln pass applies to every size; small batches choose their GEMM kernels apart from the
    # rest, and the two agree here: the demo's projections are too small to time, torch's GEMM stays
    [variant] = manifest["variants"]
    assert variant["ranges"] == [[1, 8], [9, 32], [33, 2048]] and variant["sizes"] == []  # cut for the GEMM choice
    assert variant["kernel_choices"] == []  # on CPU no kernel competes with Inductor's code
    gemms = variant["gemm_choices"]
    assert len(gemms) == 4 and sum(c["calls"] for c in gemms) == 4 * 4 and {c["kind"] for c in gemms} == {"float"}
    assert all(c["tokens"] == list(measured_tokens((1, 8))) and c["kernel"] == "aten" and c["ms"] == {}
               for c in gemms)
    assert variant["weight_formats"] == {}
    assert manifest["lm_head"]["choice"]["tokens"] == [1, 16]
    head = manifest["lm_head"]  # the demo's head is too small to time: no format, no screen, no library
    assert head["choice"]["kernel"] == "aten" and head["format"] is None and head["screen"] is None
    assert "libraries" not in head
    assert len(variant["pieces"]) == 5 and len({p["sizes"]["dynamic"]["sha256"] for p in variant["pieces"].values()}) == 3
    assert {e["kind"] for e in manifest["inputs"]} == {"weight", "input", "meta", "kv_cache", "size"}
    kv = next(e for e in manifest["inputs"] if e["kind"] == "kv_cache")
    assert kv["shape"][1] is None and kv["shape"][0] == 2  # the block count is the symbolic dimension
    blobs = {p.stem: p.stat().st_size for p in (llama_artifact / "blobs").glob("*.so")}
    entries = [e for p in variant["pieces"].values() for e in p["sizes"].values()]
    [(name, library)] = manifest["libraries"].items()  # fp32 on CPU: the decode attention ships
    assert name == "decode_attention" and library["sha256"] not in {e["sha256"] for e in entries}
    assert {e["sha256"]: e["bytes"] for e in entries + [library]} == blobs
    calls = {e["sha256"]: e["calls"]["bytes"] for e in entries if e["calls"] is not None}  # pieces calling kiln ops
    assert calls == {} and not list((llama_artifact / "blobs").glob("*.json"))  # none: the KV write is lowered
    program = (llama_artifact / "programs" / "0.py").read_text()
    passed = {name: [a.strip() for a in args.split(",")] for name, args in re.findall(r"self\.(submod_\d+)\(([^)]*)\)",
                                                                                       program)}
    for name, piece in variant["pieces"].items():  # a library takes the tensors; sizes (s0, s44_3) it reads off them
        assert piece["tensor_args"] == [i for i, a in enumerate(passed[name]) if not re.fullmatch(r"s\d+(_\d+)?", a)]
    assert program.count("attention_call(") == 4 and "self.submod_8(" in program  # no op dispatch on CPU
    assert "torch.ops.kiln.attention" not in program


def test_static_sizes_are_used_for_their_token_count(tmp_path, demo_dirs, kiln_cache, llama_artifact):
    counters.clear()
    llm = LLM(demo_dirs["llama"], compile=True, cache_dir=kiln_cache, compile_config=CompileConfig(sizes=(1,)))
    # another key, but its dynamic pieces are the default artifact's: the piece cache serves them
    assert counters["pieces_cached"] >= 3 and counters["pieces_compiled"] + counters["pieces_cached"] == 6
    [program] = {forward.__self__ for _, forward in llm.engine.runner.forward.graph.routes}
    pieces = [p for p in program.__dict__.values() if hasattr(p, "static")]
    assert len(pieces) == 5 and all(set(p.static) == {1} for p in pieces)
    calls = {"static": 0}
    for piece in pieces:
        fn = piece.static[1]
        piece.static[1] = lambda *a, fn=fn: calls.__setitem__("static", calls["static"] + 1) or fn(*a)
    out = llm.generate(["The kiln was"], GREEDY)[0]  # one prompt: every decode step has one token
    assert calls["static"] == 5 * (GREEDY.max_tokens - 1)
    assert out.token_ids == LLM(demo_dirs["llama"]).generate(["The kiln was"], GREEDY)[0].token_ids


def test_compile_cli_prints_stages_and_dumps(tmp_path, demo_dirs, capsys):
    dump = tmp_path / "dump"
    argv = ["compile", str(demo_dirs["qwen3"]), "--cache-dir", str(tmp_path / "c"), "--dump-dir", str(dump), "-q"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for stage in ("trace", "passes", "split", "compile", "save", "total"):
        assert any(line.split()[:1] == [stage] for line in out.splitlines())
    path = Path(out.strip().splitlines()[-1])
    artifact.verify(path)
    assert (dump / "graphs" / "before_split.py").is_file() and (dump / "graphs" / "after_split.py").is_file()
    assert len(list((dump / "graphs").glob("submod_*.py"))) == 9
    assert list(dump.glob("full_code_for_*.py"))  # depyf's decompiled bytecode
    assert main(argv[:-3] + ["-q"]) == 0 and "already present" in capsys.readouterr().out


def test_compile_cli_rejects_bad_input(tmp_path, capsys):
    assert main(["compile", str(tmp_path / "nope")]) == 1
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["compile", str(tmp_path), "--sizes", "1,x"])
    assert "comma-separated" in capsys.readouterr().err


def test_batch_budget_above_compiled_max_is_refused(demo_dirs, kiln_cache):
    with pytest.raises(KilnError, match="exceeds the compiled max_num_tokens 2048"):
        LLM(demo_dirs["llama"], compile=True, cache_dir=kiln_cache, max_num_batched_tokens=4096)


def test_default_cache_dir_follows_kiln_cache(monkeypatch, tmp_path):
    from kiln.config import default_cache_dir

    monkeypatch.setenv("KILN_CACHE", str(tmp_path / "k"))
    assert default_cache_dir() == tmp_path / "k"
    monkeypatch.delenv("KILN_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "kiln"


def test_runtime_never_imports_the_tracing_path():
    code = "import sys, kiln.compiler.artifact, kiln.llm; print(sorted(m for m in sys.modules if m.startswith('kiln.compiler')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ).stdout
    assert "kiln.compiler.trace" not in out and "kiln.compiler.compile" not in out


def test_generate_cli_runs_the_artifact(demo_dirs, kiln_cache, llama_artifact, capsys):
    argv = ["generate", str(demo_dirs["llama"]), "--prompt", "The kiln was", "--max-tokens", "8", "--cache-dir",
            str(kiln_cache), "--require-artifact"]
    assert main(argv) == 0
    compiled = capsys.readouterr().out
    assert main(argv[:-1]) == 0  # eager
    assert capsys.readouterr().out == compiled and compiled.startswith("The kiln was")


def test_artifact_refuses_a_model_it_was_not_built_for(demo_dirs, llama_artifact):
    with pytest.raises(artifact.ArtifactError, match="expects weight model.embed_tokens.weight .* the model has"):
        bind.load(llama_artifact, LLM(demo_dirs["qwen2"]).model)


def test_an_artifact_named_by_path_runs_without_a_key_lookup(demo_dirs, llama_artifact, tmp_path):
    llm = LLM(demo_dirs["llama"], artifact=llama_artifact)
    assert llm.artifact_path == llama_artifact
    eager = LLM(demo_dirs["llama"]).generate(["The kiln was"], GREEDY)[0]
    assert llm.generate(["The kiln was"], GREEDY)[0].token_ids == eager.token_ids
    with pytest.raises(KilnError, match="exceeds the max_num_tokens 2048"):
        LLM(demo_dirs["llama"], artifact=llama_artifact, max_num_batched_tokens=4096)
    with pytest.raises(artifact.ArtifactMissing):
        LLM(demo_dirs["llama"], artifact=tmp_path / "nothing")


def test_variants_read_the_weight_formats_their_gemm_choices_asked_for(demo_dirs, tmp_path, monkeypatch):
    """Small batches and the rest choose their GEMM kernels apart; where the choices differ the artifact
    holds a variant for each, each reading the weights in its own format, and both give eager's tokens."""
    from kiln.passes import gemm_choice

    def packed_wins_above_small_batches(fn, args):  # oneDNN's; kiln's panel GEMM never wins here
        if fn.kernel != "onednn":
            return 2.0 if fn.kernel == "aten" else 4.0
        return 3.0 if args[0].shape[0] <= gemm_choice.SMALL_BATCH else 1.0

    monkeypatch.setattr(gemm_choice, "_streamed_time", packed_wins_above_small_batches)
    monkeypatch.setattr(gemm_choice, "MIN_TIMED_ELEMENTS", 0)  # the demo's projections are time-worthy here
    llm = LLM(demo_dirs["llama"], compile=True, cache_dir=tmp_path)
    manifest = artifact.read_manifest(llm.artifact_path)
    small, rest = manifest["variants"]
    assert small["ranges"] == [[1, gemm_choice.SMALL_BATCH]]
    assert rest["ranges"] == [[gemm_choice.SMALL_BATCH + 1, gemm_choice.DECODE_BATCH], [gemm_choice.DECODE_BATCH + 1, 2048]]
    assert small["weight_formats"] == {} and len(rest["weight_formats"]) == 4 * 4
    assert {c["kernel"] for c in small["gemm_choices"]} == {"aten"} and {c["kernel"] for c in rest["gemm_choices"]} == {
        "onednn"}
    assert not hasattr(llm.model, "released_weights")  # the small batches' variant reads every weight plain
    eager = LLM(demo_dirs["llama"])
    for prompts in (PROMPTS[:1], PROMPTS):  # decodes of 1 and of 8 sequences; prefills of more than 8 tokens
        for got, want in zip(llm.generate(prompts, GREEDY), eager.generate(prompts, GREEDY)):
            assert got.token_ids == want.token_ids
            torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=0)
