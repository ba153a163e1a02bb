"""`kiln cache`: every subcommand on real artifacts (copies of the session's compiled demo llama)."""

import copy
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.units import parse_age, parse_size
from kiln.cli import main
from kiln.compiler import artifact, usage
from kiln.compiler.key import cache_key, model_factors
from kiln.config import CompileConfig, PassConfig
from kiln.models.config import ModelConfig
from kiln.models.registry import create_model
from tests.processes import bare_env, free_port, serving

DAY = 86400.0


def kiln_cache_cmd(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    status = main(["cache", *map(str, args)])
    out = capsys.readouterr()
    return status, out.out + out.err


def as_json(capsys, *args):
    status, out = kiln_cache_cmd(capsys, *args, "--json")
    assert status == 0, out
    return json.loads(out)


@pytest.fixture
def cache(tmp_path, llama_artifact) -> Path:
    """A private cache holding a copy of the session's llama artifact (tests here damage and delete)."""
    cache = tmp_path / "cache"
    shutil.copytree(llama_artifact, cache / llama_artifact.name)
    return cache


def _with_factors(cache: Path, source: Path, factors: dict) -> Path:
    """A copy of `source` as a compile with `factors` would have filed it."""
    key = cache_key(factors)
    shutil.copytree(source, cache / key)
    manifest = json.loads((cache / key / artifact.MANIFEST).read_text())
    manifest["factors"], manifest["key"] = factors, key
    artifact.write_manifest(cache / key, manifest)
    return cache / key


def test_units():
    assert parse_size("10G") == 10 << 30 and parse_size("500m") == 500 << 20 and parse_size("1.5KiB") == 1536
    assert parse_age("7d") == 7 * DAY and parse_age("12h") == 12 * 3600
    with pytest.raises(ValueError, match="expected a size"):
        parse_size("ten gigs")


def test_ls_and_info(cache, llama_artifact, demo_dirs, capsys):
    key = llama_artifact.name
    status, out = kiln_cache_cmd(capsys, "ls", "--cache-dir", cache)
    assert status == 0 and key[:12] in out and "llama (LlamaForCausalLM, 4L)" in out and "never" in out
    (entry,) = as_json(capsys, "ls", "--cache-dir", cache)
    files = [p for p in (cache / key).rglob("*") if p.is_file()]
    assert entry["bytes"] == sum(p.stat().st_size for p in files)
    assert entry["torch"] == torch.__version__ and entry["isa"] == torch.backends.cpu.get_cpu_capability()
    assert entry["model"] == "llama" and entry["last_used"] is None

    LLM(demo_dirs["llama"], compile=True, cache_dir=cache, require_artifact=True)  # a load is a use
    (entry,) = as_json(capsys, "ls", "--cache-dir", cache)
    assert entry["last_used"] is not None and time.time() - entry["last_used"] < 60

    manifest = json.loads((cache / key / artifact.MANIFEST).read_text())
    status, out = kiln_cache_cmd(capsys, "info", key[:6], "--cache-dir", cache)
    assert status == 0
    for name, piece in manifest["variants"][0]["pieces"].items():
        assert f"{name}  dynamic  {piece['sizes']['dynamic']['sha256'][:16]}" in out
    for p in manifest["variants"][0]["passes"]:
        assert any(line.split()[:2] == [p["name"], str(p["matches"])] for line in out.splitlines()), p
    assert "trace" in out and "compile" in out and "total" in out
    library = manifest["libraries"]["decode_attention"]
    assert any(line.split()[:3] == ["libraries", "decode_attention", library["sha256"][:16]] for line in out.splitlines())
    assert as_json(capsys, "info", key, "--cache-dir", cache)["manifest"] == manifest

    status, out = kiln_cache_cmd(capsys, "info", "ffff", "--cache-dir", cache)
    assert status == 1 and "no artifact 'ffff'" in out and "Traceback" not in out


def test_info_shows_the_gguf_types_an_artifact_was_compiled_for(llama_artifact, tmp_path, capsys):
    kept = Path(shutil.copytree(llama_artifact, tmp_path / llama_artifact.name))
    manifest = json.loads((kept / artifact.MANIFEST).read_text())
    artifact.write_manifest(kept, {**manifest, "weight_types": {"F32": 9, "Q4_K": 12, "Q6_K": 2}})
    status, out = kiln_cache_cmd(capsys, "info", kept.name, "--cache-dir", tmp_path)
    assert status == 0 and "GGUF types  9 F32, 12 Q4_K, 2 Q6_K (the file it was compiled for)" in out


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_names_the_corrupt_file(tmp_path, packed_artifact, capsys):
    cache = tmp_path / "packed"  # an artifact whose pieces call kiln ops: it has call tables
    shutil.copytree(packed_artifact, cache / packed_artifact.name)
    status, out = kiln_cache_cmd(capsys, "verify", "--cache-dir", cache)
    assert status == 0 and out.startswith(f"ok      {packed_artifact.name}")
    blob = sorted((cache / packed_artifact.name / "blobs").glob("*.so"))[0]
    _flip_byte(blob)
    calls = sorted((cache / packed_artifact.name / "blobs").glob("*.json"))[-1]
    calls.unlink()
    status, out = kiln_cache_cmd(capsys, "verify", packed_artifact.name[:8], "--cache-dir", cache)
    assert status == 1
    assert f"artifact blob {blob} is corrupt (sha256 mismatch)" in out
    assert f"artifact blob call table {calls} is missing" in out
    (verdict,) = json.loads(kiln_cache_cmd(capsys, "verify", "--cache-dir", cache, "--json")[1])
    assert not verdict["ok"] and len(verdict["problems"]) == 2


def test_verify_catches_a_renamed_artifact(cache, llama_artifact, capsys):
    os.replace(cache / llama_artifact.name, cache / ("0" * 32))
    status, out = kiln_cache_cmd(capsys, "verify", "--cache-dir", cache)
    assert status == 1 and f"its factors hash to {llama_artifact.name}: it was renamed or edited" in out


def _factors(model_dir: Path, dtype: torch.dtype, passes: PassConfig) -> dict:
    model = create_model(ModelConfig.from_model_dir(model_dir), dtype)
    return model_factors(model, CompileConfig(passes=passes))


def test_explain_two_keys_that_differ_in_dtype_and_one_pass(cache, llama_artifact, demo_dirs, capsys):
    mine = _factors(demo_dirs["llama"], torch.float32, PassConfig())
    assert cache_key(mine) == llama_artifact.name  # the factors `kiln compile` would use
    other = _with_factors(cache, llama_artifact, _factors(demo_dirs["llama"], torch.bfloat16,
                                                          PassConfig(rms_quant=False)))
    status, out = kiln_cache_cmd(capsys, "explain", llama_artifact.name, other.name[:10], "--cache-dir", cache)
    assert status == 0
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[1:]}
    assert set(rows) == {"dtype", "compile.passes.rms_quant", "passes.rms_quant"}, out
    assert rows["dtype"][:2] == ["float32", "bfloat16"]
    assert rows["compile.passes.rms_quant"][:2] == ["True", "False"]
    assert "pass rms_quant runs for" in out and llama_artifact.name[:12] in out
    diff = as_json(capsys, "explain", llama_artifact.name, other.name, "--cache-dir", cache)["differences"]
    assert [d["factor"] for d in diff] == ["compile.passes.rms_quant", "dtype", "passes.rms_quant"]


def test_explain_a_model_against_the_cache(cache, llama_artifact, demo_dirs, capsys):
    model = demo_dirs["llama"]
    status, out = kiln_cache_cmd(capsys, "explain", "--model", model, "--cache-dir", cache)
    assert status == 0 and f"{llama_artifact.name} is in the cache" in out
    got = as_json(capsys, "explain", "--model", model, "--cache-dir", cache, "--dtype", "bfloat16",
                  "--disable-pass", "act-quant")
    assert got["hit"] is False and got["nearest"] == llama_artifact.name
    assert [d["factor"] for d in got["differences"]] == ["compile.passes.act_quant", "dtype", "passes.act_quant"]
    status, out = kiln_cache_cmd(capsys, "explain", "--cache-dir", cache, llama_artifact.name)
    assert status == 1 and "two keys" in out
    # an int8 LM head is a factor: its kernel ships in the artifact, so `kiln compile --lm-head-quantization`
    # builds the artifact the LLM asking for that head looks up
    got = as_json(capsys, "explain", "--model", model, "--cache-dir", cache, "--lm-head-quantization", "int8")
    assert [d["factor"] for d in got["differences"]] == ["lm_head_quantization"]
    with pytest.raises(artifact.ArtifactMissing, match=got["key"]):
        LLM(model, cache_dir=cache, require_artifact=True, lm_head_quantization="int8")


HOLD = """
import sys
from pathlib import Path
from kiln.compiler import usage
path = Path(sys.argv[2])
if sys.argv[1] == "load":
    lease = usage.acquire(path)
    print("held", flush=True)
    sys.stdin.read()
else:
    with usage.compile_lock(path):
        print("held", flush=True)
        sys.stdin.read()
"""


def _holder(how: str, path: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, how, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _age(path: Path, days: float) -> None:
    t = time.time() - days * DAY
    os.utime(path, (t, t))
    if usage.use_file(path).exists():
        os.utime(usage.use_file(path), (t, t))


def test_prune_by_age_skips_keys_in_use(cache, llama_artifact, capsys):
    keys = [llama_artifact.name] + [_with_factors(cache, llama_artifact, {"copy": i}).name for i in range(4)]
    paths = [cache / k for k in keys]
    loaded, compiling = _holder("load", paths[2]), _holder("compile", paths[3])
    for path, days in zip(paths, [1, 8, 9, 10, 11]):
        _age(path, days)
    usage.record_use(paths[4])  # created long ago, used just now: recent
    try:
        status, out = kiln_cache_cmd(capsys, "prune", "--older-than", "7d", "--dry-run", "--cache-dir", cache)
        assert status == 0 and all(p.exists() for p in paths) and "would remove 3 artifacts" in out
        got = as_json(capsys, "prune", "--older-than", "7d", "--cache-dir", cache)
    finally:
        for proc in (loaded, compiling):
            proc.communicate("")
    assert got["removed"] == [keys[1]]
    assert got["busy"] == {keys[2]: f"{keys[2]} is loaded by a running process",
                           keys[3]: f"{keys[3]} is being compiled"}
    assert [p.exists() for p in paths] == [True, False, True, True, True]
    assert not usage.use_file(paths[1]).exists() and not list(cache.glob(".stale-*"))


def test_prune_to_a_size_removes_least_recently_used(cache, llama_artifact, capsys):
    keys = [llama_artifact.name] + [_with_factors(cache, llama_artifact, {"copy": i}).name for i in range(2)]
    for key, days in zip(keys, [3, 1, 2]):
        _age(cache / key, days)
    size = sum(p.stat().st_size for p in (cache / keys[0]).rglob("*") if p.is_file())
    got = as_json(capsys, "prune", "--max-size", f"{2 * size + 100}B", "--cache-dir", cache)
    assert got["removed"] == [keys[0]] and got["freed_bytes"] == size
    assert sorted(p.name for p in cache.iterdir() if not p.name.startswith(".")) == sorted(keys[1:])
    with pytest.raises(SystemExit) as exit:
        main(["cache", "prune", "--max-size", "lots", "--cache-dir", str(cache)])
    assert exit.value.code == 2 and "expected a size like 500M or 10G, got 'lots'" in capsys.readouterr().err
    status, out = kiln_cache_cmd(capsys, "prune", "--cache-dir", cache)
    assert status == 1 and "prune needs --older-than AGE, --max-size SIZE or both" in out


def test_export_import_then_serve_with_no_compiler(cache, llama_artifact, demo_dirs, tmp_path, capsys):
    tarball = tmp_path / "out" / "llama.tar.gz"
    status, out = kiln_cache_cmd(capsys, "export", llama_artifact.name[:8], "-o", tarball, "--cache-dir", cache)
    assert status == 0 and tarball.is_file() and not list(tarball.parent.glob(".*"))
    with tarfile.open(tarball) as tar:
        assert {Path(m.name).parts[0] for m in tar.getmembers()} == {llama_artifact.name}

    fresh = tmp_path / "fresh-cache"
    got = as_json(capsys, "import", tarball, "--cache-dir", fresh)
    assert got == {"key": llama_artifact.name, "path": str(fresh / llama_artifact.name), "new": True}
    assert as_json(capsys, "import", tarball, "--cache-dir", fresh)["new"] is False
    assert kiln_cache_cmd(capsys, "verify", "--cache-dir", fresh)[0] == 0

    port = free_port()
    env = bare_env(tmp_path / "bare")
    cmd = [sys.executable, "-m", "kiln", "-v", "serve", str(demo_dirs["llama"]), "--port", str(port),
           "--cache-dir", str(fresh), "--require-artifact"]
    import httpx

    body = {"model": "llama", "prompt": "The kiln was", "max_tokens": 8, "temperature": 0}
    with serving(cmd, port, tmp_path / "serve.log", env=env) as url:
        served = httpx.post(f"{url}/v1/completions", json=body).json()["choices"][0]["text"]
    log = (tmp_path / "serve.log").read_text()
    assert f"loaded artifact {llama_artifact.name}" in log and "compiling" not in log
    eager = LLM(demo_dirs["llama"]).generate("The kiln was", SamplingParams(max_tokens=8, temperature=0))[0]
    assert served == eager.text


def test_import_refuses_damaged_and_foreign_tarballs(cache, llama_artifact, tmp_path, capsys):
    blob = sorted((cache / llama_artifact.name / "blobs").glob("*.so"))[0]
    _flip_byte(blob)
    status, out = kiln_cache_cmd(capsys, "export", llama_artifact.name, "-o", tmp_path / "x.tar.gz", "--cache-dir",
                                 cache)
    assert status == 1 and "will not export a damaged artifact" in out and not (tmp_path / "x.tar.gz").exists()

    damaged = tmp_path / "damaged.tar.gz"
    with tarfile.open(damaged, "w:gz") as tar:
        tar.add(cache / llama_artifact.name, arcname=llama_artifact.name)
    fresh = tmp_path / "fresh"
    status, out = kiln_cache_cmd(capsys, "import", damaged, "--cache-dir", fresh)
    assert status == 1 and f"blobs/{blob.name} is corrupt (sha256 mismatch)" in out
    assert not [p for p in fresh.iterdir() if not p.name.startswith(".")] and not list(fresh.glob(".import-*"))

    foreign = tmp_path / "foreign.tar.gz"
    with tarfile.open(foreign, "w:gz") as tar:
        tar.add(cache / llama_artifact.name / artifact.MANIFEST, arcname="../etc/manifest.json")
    status, out = kiln_cache_cmd(capsys, "import", foreign, "--cache-dir", fresh)
    assert status == 1 and "../etc/manifest.json, a path outside its artifact directory" in out
    two = tmp_path / "two.tar.gz"
    with tarfile.open(two, "w:gz") as tar:
        tar.add(cache / llama_artifact.name / artifact.MANIFEST, arcname="other/manifest.json")
    status, out = kiln_cache_cmd(capsys, "import", two, "--cache-dir", fresh)
    assert status == 1 and "is not a kiln artifact export" in out
    status, out = kiln_cache_cmd(capsys, "import", tmp_path / "nothing.tar.gz", "--cache-dir", fresh)
    assert status == 1 and "does not exist" in out


def test_import_refuses_links_and_paths_leading_out(cache, llama_artifact, tmp_path, capsys):
    key, manifest = llama_artifact.name, cache / llama_artifact.name / artifact.MANIFEST
    fresh = tmp_path / "fresh"

    def tarball(name: str, add) -> Path:
        path = tmp_path / f"{name}.tar.gz"
        with tarfile.open(path, "w:gz") as tar:
            tar.add(cache / key, arcname=key)
            add(tar)
        return path

    def link(kind: bytes, name: str, target: str):
        def add(tar):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            tar.addfile(info)
        return add

    cases = {
        "climbs out": (tarball("climb", lambda tar: tar.add(manifest, arcname=f"{key}/../evil.py")),
                       f"holds {key}/../evil.py, a path outside its artifact directory"),
        "symlink": (tarball("sym", link(tarfile.SYMTYPE, f"{key}/programs/x.py", "/etc/passwd")),
                    f"holds a link, {key}/programs/x.py -> /etc/passwd"),
        "hard link": (tarball("hard", link(tarfile.LNKTYPE, f"{key}/y", f"{key}/manifest.json")), "holds a link"),
    }
    for name, (path, message) in cases.items():
        status, out = kiln_cache_cmd(capsys, "import", path, "--cache-dir", fresh)
        assert status == 1 and message in out, name
        assert not (tmp_path / "evil.py").exists() and not (fresh / "evil.py").exists()
        assert not fresh.exists()  # refused from the headers: not even the cache directory was made


def test_export_writes_a_detached_sha256_that_import_checks(cache, llama_artifact, tmp_path, capsys):
    tarball = tmp_path / "llama.tar.gz"
    got = as_json(capsys, "export", llama_artifact.name, "-o", tarball, "--sha256", "--cache-dir", cache)
    digest_file = Path(got["sha256_file"])
    hexdigest = hashlib.sha256(tarball.read_bytes()).hexdigest()
    assert digest_file == Path(f"{tarball}.sha256") and digest_file.read_text() == f"{hexdigest}  llama.tar.gz\n"
    fresh = tmp_path / "fresh"
    wrong = "0" * 64
    status, out = kiln_cache_cmd(capsys, "import", tarball, "--sha256", wrong, "--cache-dir", fresh)
    assert status == 1 and f"not the {wrong} given" in out and not (fresh / llama_artifact.name).exists()
    status, out = kiln_cache_cmd(capsys, "import", tarball, "--sha256", "nonsense", "--cache-dir", fresh)
    assert status == 1 and "64 hex digits" in out
    assert as_json(capsys, "import", tarball, "--sha256", digest_file, "--cache-dir", fresh)["new"] is True
    assert as_json(capsys, "import", tarball, "--sha256", hexdigest.upper(), "--cache-dir", fresh)["new"] is False


def test_dump_writes_readable_code(cache, llama_artifact, tmp_path, capsys):
    out_dir = tmp_path / "dump"
    status, out = kiln_cache_cmd(capsys, "dump", llama_artifact.name, "-o", out_dir, "--cache-dir", cache)
    assert status == 0
    manifest = json.loads((out_dir / artifact.MANIFEST).read_text())
    assert (out_dir / "programs" / "0.py").read_text() == (cache / llama_artifact.name / "programs" / "0.py").read_text()
    assert "def backbone(input_ids, positions, kv_caches, attn_metadata)" in \
        (out_dir / "debug" / "dynamo" / "decompiled.py").read_text()
    assert "torch.ops.kiln.attention" in (out_dir / "debug" / "graphs" / "before_passes.py").read_text()
    assert len(list((out_dir / "debug" / "graphs").glob("submod_*.py"))) == 9  # 4 layers: 2L+1 pieces
    blobs = {e["sha256"] for p in manifest["variants"][0]["pieces"].values() for e in p["sizes"].values()}
    library = manifest["libraries"]["decode_attention"]["sha256"]
    generated = list((out_dir / "debug" / "inductor").iterdir())
    assert sorted(p.name for p in generated) == sorted(sha[:16] for sha in blobs | {library}) and len(blobs) == 3
    for folder in generated:
        users = (folder / "USERS").read_text()
        assert "AOTInductorModel::run_impl" in (folder / "wrapper.cpp").read_text()
        if folder.name == library[:16]:  # the one op's C++ is in the wrapper, Inductor generated no kernel
            assert users == "library decode_attention\n"
            assert 'extern "C" void kiln_decode_attention' in (folder / "wrapper.cpp").read_text()
        else:
            assert users.startswith("variant 0 submod_")
            assert 'extern "C"' in (folder / "kernel.cpp").read_text()
    status, out = kiln_cache_cmd(capsys, "dump", llama_artifact.name, "-o", out_dir, "--cache-dir", cache)
    assert status == 1 and "is not empty" in out


GIB = 1 << 30


def _read_tar(tarball: Path) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    with tarfile.open(tarball) as tar:
        return [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar.getmembers()]


def _write_tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    """A plain tarball of `members`; one whose data is None has only its header, the size it declares
    left as a hole in a sparse file: a 10 GiB member costs no disk, and any attempt to unpack it would."""
    with open(path, "wb") as f:
        for info, data in members:
            f.write(info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape"))
            padded = -(-info.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
            if data is None and info.size:
                f.seek(padded, os.SEEK_CUR)
            elif data is not None:
                f.write(data.ljust(padded, b"\0"))
        f.write(b"\0" * 2 * tarfile.BLOCKSIZE)
    assert path.stat().st_blocks * 512 < 64 << 20  # nothing huge was written to build it
    return path


def _with(member: tarfile.TarInfo, **attrs) -> tarfile.TarInfo:
    """A copy of `member` with other header fields (TarInfo.replace takes no size)."""
    made = copy.copy(member)
    for name, value in attrs.items():
        setattr(made, name, value)
    return made


def _disk_state(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*")} if folder.exists() else {}


def test_import_refuses_what_the_manifest_does_not_list_before_writing(cache, llama_artifact, tmp_path, capsys):
    from kiln.cache_tools import transfer
    from kiln.errors import KilnError

    key = llama_artifact.name
    exported = tmp_path / "art.tar.gz"
    assert kiln_cache_cmd(capsys, "export", key, "-o", exported, "--cache-dir", cache)[0] == 0
    members = _read_tar(exported)
    names = [m.name for m, _ in members]
    assert names[:2] == [key, f"{key}/{artifact.MANIFEST}"]  # the manifest first: later members checked as read
    manifest = json.loads(members[1][1])
    pinned = {f"{key}/{p.relative_to(key).as_posix()}": e["bytes"]
              for p, e, _ in artifact.pinned_files(Path(key), manifest)}
    assert {n for n, (m, _) in zip(names, members) if m.isfile()} == set(pinned) | {names[1]}
    blob = next(n for n in names if n.endswith(".so"))
    program = f"{key}/programs/0.py"

    def info(name: str, size: int = 0, dir: bool = False) -> tarfile.TarInfo:
        made = tarfile.TarInfo(name)
        made.type, made.size, made.mode = (tarfile.DIRTYPE, 0, 0o755) if dir else (tarfile.REGTYPE, size, 0o644)
        return made

    def edited(**changes) -> list:
        """The export's members, some resized (None: header only) or renamed."""
        out = []
        for m, data in members:
            if m.name in changes:
                size, new = changes[m.name]
                out.append((_with(m, size=size if new is None else len(new)), new))
            else:
                out.append((m, data))
        return out

    def crafted(edit) -> bytes:
        """The manifest edited, with its digest redone (the key hashes the factors only, so it still holds)."""
        m = json.loads(members[1][1])
        edit(m)
        return artifact._manifest_text(m).encode()

    def with_manifest(data: bytes, rest: list) -> list:
        return [members[0], (_with(members[1][0], size=len(data)), data)] + rest

    manifest_last = members[:1] + members[2:] + members[1:2]
    huge_manifest = crafted(lambda m: m["debug"].update({"huge.bin": {"bytes": 10 * GIB, "sha256": "0" * 64}}))
    outside = crafted(lambda m: m["debug"].update({"../../../evil.py": {"bytes": 1, "sha256": "0" * 64}}))
    dirs = [(info(f"{key}/debug/empty{i}", dir=True), None) for i in range(2000)]
    cases = {
        "oversized member": (edited(**{blob: (10 * GIB, None)}), (),
                             f"holds {blob} of {10 * GIB} bytes, but its manifest pins {pinned[blob]}: refusing it"),
        "oversized member before the manifest": (
            [(_with(m, size=10 * GIB), None) if m.name == blob else (m, d) for m, d in manifest_last], (),
            f"holds {blob} of {10 * GIB} bytes, but its manifest pins {pinned[blob]}"),
        "unlisted 10 GiB member": (members + [(info(f"{key}/blobs/extra.so", 10 * GIB), None)], (),
                                   f"holds {key}/blobs/extra.so, which its manifest does not list: refusing it"),
        "unlisted small member": (members + [(info(f"{key}/programs/1.py", 5), b"boom\n")], (),
                                  f"holds {key}/programs/1.py, which its manifest does not list"),
        "many empty directories": (members + dirs, (), f"holds {key}/debug/empty0, which its manifest does not list"),
        "many empty directories before the manifest": (
            manifest_last[:1] + dirs + manifest_last[1:], (),
            f"holds {key}/debug/empty0, which its manifest does not list"),
        "size differs from the pin": (
            edited(**{program: (None, members[names.index(program)][1] + b"# more\n")}), (),
            f"holds {program} of {pinned[program] + 7} bytes, but its manifest pins {pinned[program]}"),
        "a file named ./": (members + [(info("./", 3), b"abc")], (), "holds a file named './', which names no file"),
        "a member twice": (members + [members[1]], (), f"holds {key}/{artifact.MANIFEST} twice: refusing it"),
        "over --max-size": (members, ("--max-size", "1K"), "of files or more (at "),
        "manifest pins 10 GiB, over --max-size": (
            with_manifest(huge_manifest, members[2:] + [(info(f"{key}/debug/huge.bin", 10 * GIB), None)]),
            ("--max-size", "1G"), f"(at {key}/debug/huge.bin); --max-size is 1.0G: raise it if you trust this "
                                  "tarball"),
        "manifest pins a path outside": (with_manifest(outside, members[2:]), (),
                                         "a path outside its artifact directory: refusing it"),
    }
    dest = tmp_path / "dest"
    dest.mkdir()
    before = _disk_state(cache)
    for i, (name, (built, flags, message)) in enumerate(cases.items()):
        tarball = _write_tar(tmp_path / f"case{i}.tar", built)
        start = time.perf_counter()
        for target in (dest, cache):
            status, out = kiln_cache_cmd(capsys, "import", tarball, *flags, "--cache-dir", target)
            assert status == 1 and message in out, (name, out)
            assert out.startswith("kiln: error: ") and out.count("\n") == 1 and "Traceback" not in out, (name, out)
        assert time.perf_counter() - start < 10, name  # refused from the headers, not after unpacking GiBs
        assert not any(dest.iterdir()), name  # no staging leftovers, no artifact
        assert _disk_state(cache) == before, name
    with pytest.raises(KilnError, match=f"holds {blob} of {10 * GIB} bytes"):
        transfer.import_tarball(tmp_path / "api", tmp_path / "case0.tar")
    assert not (tmp_path / "api").exists()

    # `tar -C cache -czf x.tar.gz ./KEY` names members ./KEY/...; with a ./ root, it imports as exported
    dotted = [(info("./", dir=True), None)] + [(_with(m, name=f"./{m.name}"), d) for m, d in members]
    got = as_json(capsys, "import", _write_tar(tmp_path / "dotted.tar", dotted), "--cache-dir", dest)
    assert got == {"key": key, "path": str(dest / key), "new": True}
    assert kiln_cache_cmd(capsys, "verify", "--cache-dir", dest)[0] == 0
    assert sorted(str(p.relative_to(dest)) for p in (dest / key).rglob("*") if p.is_file()) == \
        sorted(n for n, (m, _) in zip(names, members) if m.isfile())
    assert not list(dest.glob(".import-*"))
