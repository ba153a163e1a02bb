"""The Triton kernels an artifact ships: recorded while they are built, packed, pinned in the
manifest, installed into a fresh Triton cache where the next build of the same kernel finds them.
The kernels are built for an H100 with Triton's own ptxas, so this runs with no GPU."""

import json
import os
import shutil

import pytest
import torch

pytest.importorskip("triton.backends.nvidia")
import triton  # noqa: E402

from kiln import LLM  # noqa: E402
from kiln.cli import main  # noqa: E402
from kiln.compiler import artifact, triton_cache  # noqa: E402
from kiln.compiler.counters import counters  # noqa: E402
from kiln.kernels.triton import rope_kv_cache  # noqa: E402
from tests.kernels.hopper import compile_for_hopper, skip_without_ptxas  # noqa: E402

skip_without_ptxas()


def _build_rope_kernel():
    """Build the RoPE + KV-write kernel for sm_90 (a small model's shapes); returns the kernel."""
    q, k, v = (torch.empty(8, heads, 64, dtype=torch.bfloat16, device="meta") for heads in (8, 2, 2))
    cache = torch.empty(2, 32, 16, 2, 64, dtype=torch.bfloat16, device="meta")
    positions = torch.empty(8, dtype=torch.int64, device="meta")
    cos_sin = torch.empty(512, 64, dtype=torch.bfloat16, device="meta")
    _, args, constexprs = rope_kv_cache.launch_arguments(positions, q, k, v, cos_sin, True, cache, positions,
                                                         torch.empty_like(q))
    return compile_for_hopper(rope_kv_cache._rope_kv_kernel, args, constexprs)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """The kernel built into a private Triton cache under a Recorder, then packed: (packed dir, cubin)."""
    root = tmp_path_factory.mktemp("triton")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(root / "build-cache"))
        with triton_cache.Recorder() as recorder:
            kernel = _build_rope_kernel()
    assert recorder.compiled == ["_rope_kv_kernel"] and len(recorder.builds) == 1
    written = triton_cache.pack(recorder.builds, root / "packed")
    (entry,) = recorder.builds
    assert sorted(written) == sorted(f"{entry}/_rope_kv_kernel.{ext}" for ext in ("cubin", "json"))  # no IR
    return root / "packed", kernel.asm["cubin"]


def test_packed_kernels_install_and_are_found_by_the_next_build(packed, tmp_path, monkeypatch):
    packed_dir, cubin = packed
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "fresh"))
    assert triton_cache.cache_dir() == tmp_path / "fresh"
    assert triton_cache.install(packed_dir) == 1
    (group,) = (tmp_path / "fresh").glob("*/__grp__*.json")
    paths = json.loads(group.read_text())["child_paths"].values()
    assert all(str(tmp_path / "fresh") in p for p in paths)  # relocated: Triton's group files hold absolute paths
    with triton_cache.Recorder() as recorder:
        kernel = _build_rope_kernel()
    assert recorder.compiled == [] and len(recorder.builds) == 1  # found, not compiled
    assert kernel.asm["cubin"] == cubin
    assert triton_cache.install(packed_dir) == 0  # already there: left alone


def test_an_entry_missing_its_metadata_is_skipped(packed, tmp_path, caplog):
    packed_dir, _ = packed
    broken = tmp_path / "broken"
    shutil.copytree(packed_dir, broken)
    for f in broken.glob("*/*.json"):
        f.unlink()
    assert triton_cache.install(broken, tmp_path / "cache") == 0
    assert "expected one metadata file" in caplog.text


def test_artifact_pins_and_installs_its_triton_kernels(packed, tmp_path, monkeypatch, llama_artifact, caplog,
                                                       capsys):
    packed_dir, _ = packed
    path = tmp_path / llama_artifact.name
    shutil.copytree(llama_artifact, path)
    assert artifact.add_triton_kernels(path, packed_dir, triton.__version__, 1.5) == 2
    manifest = artifact.verify(path)
    assert manifest["triton_kernels"]["triton"] == triton.__version__
    assert manifest["timings"]["triton_kernels"] == 1.5
    assert main(["cache", "info", path.name, "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"triton kernels  1 built by triton {triton.__version__}" in out and "2 kernels (" in out

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "serve-cache"))
    assert artifact.install_triton_kernels(path, manifest) == 1
    assert len(list((tmp_path / "serve-cache").glob("*/*.cubin"))) == 1

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "other-cache"))
    other = json.loads(json.dumps(manifest))
    other["triton_kernels"]["triton"] = "0.0.1"
    assert artifact.install_triton_kernels(path, other) == 0  # another Triton's kernels: they compile at launch
    assert "built by triton 0.0.1" in caplog.text and not (tmp_path / "other-cache").exists()

    # built with another ptxas (Inductor sets TRITON_PTXAS_PATH in a compiling process): a warning, no install
    built, here = (f"Cuda compilation tools, release {v[:4]}, V{v}\n-90" for v in ("12.8.93", "13.0.88"))
    other["triton_kernels"] |= {"triton": triton.__version__, "backend": built}
    monkeypatch.setattr(triton_cache, "backend_key", lambda: here)
    monkeypatch.setenv("TRITON_PTXAS_PATH", "/opt/torch/bin/ptxas")
    monkeypatch.setattr(triton_cache, "tools_changed_since_start", lambda: False)  # the user's shell set it
    assert artifact.install_triton_kernels(path, other) == 0 and not (tmp_path / "other-cache").exists()
    assert ("built with ptxas 12.8.93, sm_90, this process has ptxas 13.0.88, sm_90" in caplog.text
            and "TRITON_PTXAS_PATH is /opt/torch/bin/ptxas here" in caplog.text)
    caplog.clear()
    monkeypatch.setattr(triton_cache, "tools_changed_since_start", lambda: True)  # as in a compiling process
    assert artifact.install_triton_kernels(path, other) == 0 and "Triton kernels were built" not in caplog.text
    monkeypatch.setattr(triton_cache, "backend_key", lambda: built)
    assert artifact.install_triton_kernels(path, other) == 1  # the same ptxas: installed

    (cubin,) = (path / artifact.TRITON_KERNELS).glob("*/*.cubin")
    data = bytearray(cubin.read_bytes())
    data[len(data) // 2] ^= 0xFF
    cubin.write_bytes(bytes(data))
    with pytest.raises(artifact.ArtifactError, match=r"artifact Triton kernel \S+\.cubin is corrupt"):
        artifact.verify(path)


def test_the_warm_up_builds_with_the_ptxas_a_fresh_process_uses(tmp_path, monkeypatch):
    """Inductor points TRITON_PTXAS_PATH at torch's ptxas in the compiling process; a serve process
    never imports Inductor. The ptxas version is in each kernel's cache key, so the warm-up builds as
    the process started, with Triton's remembered ptxas version forgotten, and puts both back after."""
    from triton.backends.compiler import GPUTarget

    ampere = GPUTarget("cuda", 80, 32)  # built with TRITON_PTXAS_PATH's ptxas (newer archs may use another)
    fake = tmp_path / "ptxas"
    fake.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 99.0, V99.0.1'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("TRITON_PTXAS_PATH", str(fake))
    cache_dir = os.environ.get("TRITON_CACHE_DIR")
    assert triton_cache.describe_backend(triton_cache.backend_key(ampere)) == "ptxas 99.0.1, sm_80"
    with triton_cache.as_fresh_process():
        assert os.environ.get("TRITON_PTXAS_PATH") == triton_cache.startup_environ().get("TRITON_PTXAS_PATH")
        assert os.environ.get("TRITON_CACHE_DIR") == cache_dir  # where kernels go is not the key
        assert "99.0.1" not in triton_cache.backend_key(ampere)
    assert os.environ["TRITON_PTXAS_PATH"] == str(fake)
    assert triton_cache.tools_changed_since_start()  # set after this process started (by the test, here)
    assert "V99.0.1" in triton_cache.backend_key(ampere)
    assert triton_cache.describe_backend("gfx942-wave64\n") == "gfx942-wave64"  # no ptxas in it: as it is


def test_watch_counts_compiles_not_cache_hits(packed, tmp_path, monkeypatch):
    packed_dir, _ = packed
    triton_cache.watch()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "watched"))
    before = counters["triton_kernels_compiled"]
    _build_rope_kernel()  # an empty cache: compiled
    assert counters["triton_kernels_compiled"] == before + 1
    seen = triton_cache.compiled_kernels[-1]  # named with its entry and specialization, to tell a mismatch
    assert seen["name"] == "_rope_kv_kernel" and (tmp_path / "watched" / seen["entry"]).is_dir()
    assert "16" in seen["attrs"]  # the pointers' divisibility Triton specialized on
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "installed"))
    triton_cache.install(packed_dir)
    _build_rope_kernel()  # found
    assert counters["triton_kernels_compiled"] == before + 1


def test_warm_up_runs_decodes_and_a_prefill_per_variant_and_writes_nothing(demo_dirs, kiln_cache, llama_artifact):
    runner = LLM(demo_dirs["llama"], compile=True, cache_dir=kiln_cache, require_artifact=True).engine.runner
    program = runner.forward
    kv_caches = [torch.zeros_like(c[:, :4]) for c in runner.kv_caches]  # 4 blocks are enough: nothing is written
    routes, calls = program.graph.routes, []

    def counted(forward):
        return lambda *args: calls.append(args[program.graph.tokens_at].shape[0]) or forward(*args)

    program.graph.routes = [(r, counted(forward)) for r, forward in routes]
    batches = program.run_each_form(kv_caches, runner.block_size)
    want = []
    for (low, high), _ in routes:
        want += [[1] * low] + ([[2] + [1] * (low - 2)] if high >= 2 else [])
    assert len(want) >= 2 and batches == want and calls == [sum(b) for b in want]
    # slots -1: nothing written but the scratch slot (the last), where the CPU pieces' scatter puts padding
    assert all(not c.flatten(1, 2)[:, :-1].any() for c in kv_caches)


def test_ship_triton_kernels_runs_the_artifact_and_pins_what_it_built(demo_dirs, llama_artifact, tmp_path):
    """The compile step's plumbing, on CPU: the program runs (no Triton launches here, so nothing is
    built) and the manifest records the empty set with this Triton's version; on CUDA the same run
    builds the attention and RoPE kernels (benchmarks/gpu_checks.py checks a serve start then compiles none)."""
    from kiln.compiler.compile import ship_triton_kernels

    path = tmp_path / llama_artifact.name
    shutil.copytree(llama_artifact, path)
    llm = LLM(demo_dirs["llama"], compile=True, cache_dir=tmp_path, require_artifact=True)
    assert ship_triton_kernels(path, llm.model) == 0
    manifest = artifact.verify(path)
    assert manifest["triton_kernels"] == {"triton": triton.__version__, "files": {},
                                          "env": {k: v for k, v in os.environ.items()
                                                  if k.startswith("TRITON_") and k != "TRITON_CACHE_DIR"}}
    assert manifest["timings"]["triton_kernels"] > 0


def test_warm_up_runs_every_variant_itself_at_small_positions():
    """A static size must not take the batches meant for the range it sits in (each variant may
    launch its own kernels), and a prefill at a range's lower bound keeps its positions small."""
    from kiln.compiler.contract import GraphInput
    from kiln.runtime.program import ByTokenCount, CompiledProgram

    seen = []

    def variant(name):
        return lambda ids, positions, slots: seen.append((name, ids.shape[0], int(positions.max()))) or ids

    inputs = [GraphInput("input", "input_ids"), GraphInput("input", "positions"), GraphInput("meta", "slot_mapping")]
    routes = [((1, 1), variant("1")), ((2, 2), variant("2")), ((1, 64), variant("1-64")),
              ((65, 128), variant("65-128"))]
    program = CompiledProgram(ByTokenCount(routes, tokens_at=0), inputs, torch.nn.Module())
    program.run_each_form([torch.zeros(2, 4, 16, 1, 8)], 16)
    assert seen == [("1", 1, 0), ("2", 2, 0), ("2", 2, 1), ("1-64", 1, 0), ("1-64", 2, 1), ("65-128", 65, 0),
                    ("65-128", 65, 1)]
