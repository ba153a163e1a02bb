"""Nothing wrong is ever served from a damaged cache: each damage an operator's disk (or an operator)
can do to a packed-weights file, a checkpoint or a manifest is refused by name or rebuilt, and every
token served after it is eager's."""

import errno
import json
import logging
import os
import random
import shutil
from pathlib import Path

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.cli import main
from kiln.compiler import artifact
from kiln.compiler.key import cache_key
from kiln.kernels import cpp_lowering, gemms, panel_linear
from kiln.weights import pack_cache
from kiln.models.demo import write_demo_model
from tests.cache_tools.test_commands import kiln_cache_cmd
from tests.oracle import PROMPTS

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
needs_panels = pytest.mark.skipif(not cpp_lowering.register()
                                  or panel_linear.available((32, 8), torch.float32) is not None,
                                  reason="kiln's panel GEMM (the packed-weights cache's user) is not available here")


def tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS[:4], GREEDY)]


@pytest.fixture(scope="module")
def panels(demo_dirs, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(a copy of the demo llama, a cache, its artifact there): every projection and the LM head on
    the panel GEMM (the choice's timings forced), so each load keeps its packed weights in the cache."""
    from kiln.passes import gemm_choice

    root = tmp_path_factory.mktemp("integrity")
    model = Path(shutil.copytree(demo_dirs["llama"], root / "model"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gemm_choice, "_streamed_time", lambda fn, args: 0.5 if fn.kernel.startswith("panels16") else 2.0)
        mp.setattr(gemm_choice, "MIN_TIMED_ELEMENTS", 0)
        llm = LLM(model, compile=True, cache_dir=root / "cache")
    llm.engine.runner.forward.pack_file.wait()
    return model, root / "cache", llm.artifact_path


@pytest.fixture(scope="module")
def eager_tokens(panels) -> list[list[int]]:
    return tokens(LLM(panels[0]))


def slot_offsets(path: Path) -> dict[str, int]:
    """Where each slot of a packed-weights file starts, from its header."""
    data = path.read_bytes()
    length = int.from_bytes(data[8:16], "little")
    offset, out = pack_cache._align(16 + length), {}
    for entry in json.loads(data[16:16 + length])["slots"]:
        out[entry["name"]] = offset
        offset = pack_cache._align(offset + pack_cache.Slot(**{**entry, "shape": tuple(entry["shape"])}).nbytes)
    return out


def writable(path: Path) -> Path:
    path.chmod(0o644)  # published read-only: an operator's edit starts with a chmod
    return path


@needs_panels
def test_a_flipped_bit_in_packed_weights_is_repacked_and_a_running_server_keeps_its_own(panels, eager_tokens,
                                                                                         caplog):
    """Item 1: one exponent bit of layer 0's o_proj panel, mtime kept; then the file truncated under
    two running loads."""
    model, cache, _ = panels
    running = LLM(model, require_artifact=True, cache_dir=cache)
    pack = running.engine.runner.forward.pack_file
    assert pack.hit and tokens(running) == eager_tokens
    [name] = [n for n in slot_offsets(pack.path) if "layers.0." in n and "o_proj" in n]
    before = pack.path.stat()
    with open(writable(pack.path), "r+b") as f:
        f.seek(slot_offsets(pack.path)[name] + 4 * 1000 + 3)  # a float's top byte: its exponent
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x40]))
    os.utime(pack.path, ns=(before.st_atime_ns, before.st_mtime_ns))  # touch -r
    assert tokens(running) == eager_tokens  # its own copy: the edit does not reach it
    with caplog.at_level(logging.WARNING, logger="kiln"):
        again = LLM(model, require_artifact=True, cache_dir=cache)
    assert f"packed weights file {pack.path} is damaged (the checksum of {name} does not match" in caplog.text
    assert not again.engine.runner.forward.pack_file.hit and tokens(again) == eager_tokens
    again.engine.runner.forward.pack_file.wait()
    with open(writable(pack.path), "r+b") as f:
        f.truncate(4096)  # mapped, this was a SIGBUS for every process reading the weights
    assert tokens(running) == eager_tokens and tokens(again) == eager_tokens
    third = LLM(model, require_artifact=True, cache_dir=cache)
    assert not third.engine.runner.forward.pack_file.hit and tokens(third) == eager_tokens
    third.engine.runner.forward.pack_file.wait()


@needs_panels
def test_a_checkpoint_rewritten_in_place_is_packed_again(panels, tmp_path):
    """Item 2: other weights of the same shapes written over the checkpoint, size, inode and mtime kept:
    the packed weights are keyed by the bytes loaded, so the load packs the new ones."""
    model, cache, _ = panels
    edited = Path(shutil.copytree(model, tmp_path / "model"))
    first = LLM(edited, require_artifact=True, cache_dir=cache)
    assert first.engine.runner.forward.pack_file.hit  # the same bytes, wherever they are: the same key
    other = write_demo_model(tmp_path / "other", seed=1, train_steps=0)
    weights = edited / "model.safetensors"
    before, data = weights.stat(), (other / "model.safetensors").read_bytes()
    assert len(data) == before.st_size
    with open(weights, "r+b") as f:
        f.write(data)
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = weights.stat()
    assert (after.st_size, after.st_ino, after.st_mtime_ns) == (before.st_size, before.st_ino, before.st_mtime_ns)
    second = LLM(edited, require_artifact=True, cache_dir=cache)
    assert not second.engine.runner.forward.pack_file.hit
    new = tokens(LLM(edited))
    assert tokens(second) == new != tokens(first)
    second.engine.runner.forward.pack_file.wait()


def _drop_weight_format(text: str) -> str:
    manifest = json.loads(text)
    formats = manifest["variants"][0]["weight_formats"]
    formats.pop(sorted(formats)[0])
    return json.dumps(manifest, indent=1, sort_keys=True) + "\n"


def _in_weight_formats(old: str, new: str):
    """An edit of the first `old` in the manifest's weight formats."""
    def edit(text: str) -> str:
        at = text.index('"weight_formats"')
        return text[:at] + text[at:].replace(old, new, 1)
    return edit


MANIFEST_EDITS = {
    "a weight_formats entry removed": _drop_weight_format,
    "a slot renamed": _in_weight_formats("layers.0.", "layers.1."),
    "a format renamed": _in_weight_formats('"panels16"', '"onednn"'),
}


@needs_panels
@pytest.mark.parametrize("edit", MANIFEST_EDITS)
def test_an_edited_manifest_is_refused_by_name(panels, tmp_path, capsys, edit):
    """Item 3: edits that leave valid JSON, each once loaded 0 of 5 prompts right under
    --require-artifact while `kiln cache verify` said ok."""
    model, cache, path = panels
    copy = tmp_path / "cache"
    shutil.copytree(path, copy / path.name)
    manifest = copy / path.name / artifact.MANIFEST
    text = manifest.read_text()
    edited = MANIFEST_EDITS[edit](text)
    assert edited != text and json.loads(edited)
    manifest.write_text(edited)
    with pytest.raises(artifact.ArtifactError, match="is damaged .its contents do not match its digest"):
        LLM(model, require_artifact=True, cache_dir=copy)
    status, out = kiln_cache_cmd(capsys, "verify", path.name, "--cache-dir", copy)
    assert status == 1 and "damaged" in out and "Traceback" not in out


@needs_panels
def test_an_edited_manifest_is_rebuilt_by_default(panels, eager_tokens, tmp_path, caplog):
    model, cache, path = panels
    copy = tmp_path / "cache"
    shutil.copytree(path, copy / path.name)
    manifest = copy / path.name / artifact.MANIFEST
    manifest.write_text(MANIFEST_EDITS["a slot renamed"](manifest.read_text()))
    with caplog.at_level(logging.WARNING, logger="kiln"):
        llm = LLM(model, compile=True, cache_dir=copy)
    assert "is damaged" in caplog.text and "compiling now" in caplog.text
    assert tokens(llm) == eager_tokens
    artifact.verify(copy / path.name)  # rebuilt in place


def test_one_character_edits_to_a_manifest_are_damage_never_a_crash(llama_artifact, demo_dirs, tmp_path, capsys):
    """Item 3: 16 seeded one-character edits that each leave valid JSON (11 of 16 were a raw KeyError or
    IndexError): every one is refused as damage, by loading and by `kiln cache verify`."""
    copy = tmp_path / "cache"
    shutil.copytree(llama_artifact, copy / llama_artifact.name)
    manifest = copy / llama_artifact.name / artifact.MANIFEST
    text = manifest.read_text()
    rng = random.Random(43)
    edits = 0
    while edits < 16:
        at = rng.randrange(len(text))
        edited = text[:at] + rng.choice("0123456789abcdefxyz.,:[]{}\" ") + text[at + 1:]
        try:
            json.loads(edited)
        except ValueError:
            continue
        if edited == text:
            continue
        edits += 1
        manifest.write_text(edited)
        with pytest.raises(artifact.ArtifactError, match="run `kiln compile` again"):
            LLM(demo_dirs["llama"], require_artifact=True, cache_dir=copy)
        status, out = kiln_cache_cmd(capsys, "verify", llama_artifact.name, "--cache-dir", copy)
        assert status == 1 and "Traceback" not in out, (at, out)
    manifest.write_text(text)
    artifact.verify(copy / llama_artifact.name)


def test_an_artifact_copied_under_another_models_key_is_refused_naming_the_factor(llama_artifact, demo_dirs,
                                                                                    tmp_path):
    """Item 3: the demo with rms_norm_eps 0.5 finds the demo's artifact under its own key (a teacher-forced
    logprob difference of 9.5 was served): the load names the factor that differs."""
    other = Path(shutil.copytree(demo_dirs["llama"], tmp_path / "eps"))
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.5}))
    factors = artifact.read_manifest(llama_artifact)["factors"]
    theirs = cache_key({**factors, "model": {**factors["model"], "rms_norm_eps": 0.5}})
    shutil.copytree(llama_artifact, tmp_path / "cache" / theirs)
    with pytest.raises(artifact.ArtifactError, match=r"model\.rms_norm_eps: artifact 1e-0\d, here 0\.5"):
        LLM(other, require_artifact=True, cache_dir=tmp_path / "cache")


def test_a_full_disk_while_compiling_is_one_line_and_leaves_nothing(demo_dirs, tmp_path, monkeypatch, capsys):
    """Item 5: a compile onto a full disk (the artifact's first library write fails with ENOSPC)."""
    def full(blobs, compiled, debug):
        raise OSError(errno.ENOSPC, "No space left on device", str(blobs / "staged.so"))

    monkeypatch.setattr(artifact, "_save_library", full)
    cache = tmp_path / "cache"
    assert main(["compile", str(demo_dirs["llama"]), "--cache-dir", str(cache)]) == 1
    err = capsys.readouterr().err
    assert "kiln: error: no space left on the device writing" in err and "Traceback" not in err
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


@needs_panels
def test_an_interrupt_while_packing_is_one_line_and_leaves_nothing(panels, tmp_path, monkeypatch, capsys):
    """Item 5: SIGINT (KeyboardInterrupt) while a load packs its weights."""
    model, cache, _ = panels
    monkeypatch.setenv(pack_cache.ENV, str(tmp_path / "packed"))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(gemms, "pack", interrupted)
    argv = ["generate", str(model), "--prompt", "x", "--require-artifact", "--cache-dir", str(cache)]
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert "kiln: interrupted" in err and "Traceback" not in err
    assert not (tmp_path / "packed").exists() or not list((tmp_path / "packed").iterdir())


@needs_panels
def test_random_byte_flips_in_an_artifact_and_its_packed_file_are_caught(panels, tmp_path):
    """Seeded flips of one bit of a random byte, round-robin over every file an artifact and its packed
    weights hold (at least 200): each artifact file's flip is refused naming the file; a packed file's
    is repacked, or lands in padding no weight reads and the weights read back are bit for bit the
    packed ones."""
    model, cache, path = panels
    llm = LLM(model, require_artifact=True, cache_dir=cache)
    pack = llm.engine.runner.forward.pack_file
    identity = llm._packs.args[1]
    assert pack.hit
    original = pack_cache.PackFile(pack.path.parent, identity, pack.slots)
    expected = {(s.name, s.format): original.read(s.name, s.format) for s in pack.slots}
    original.publish()
    assert all(tensor is not None for tensor in expected.values())
    copy = tmp_path / path.name
    shutil.copytree(path, copy)
    (tmp_path / "packed").mkdir()
    packed = writable(Path(shutil.copy2(pack.path, tmp_path / "packed" / pack.path.name)))
    files = sorted(p for p in copy.rglob("*") if p.is_file()) + [packed]
    rng = random.Random(2026)
    caught = {"artifact": 0, "packed": 0}
    for case in range(max(200, len(files))):
        file = files[case % len(files)]
        original = file.read_bytes()
        at, bit = rng.randrange(len(original)), rng.randrange(8)
        file.write_bytes(original[:at] + bytes([original[at] ^ (1 << bit)]) + original[at + 1:])
        if file == packed:
            again = pack_cache.PackFile(packed.parent, identity, pack.slots)
            read = {k: again.read(*k) for k in expected}
            again.publish()
            for k, tensor in read.items():
                assert tensor is None or torch.equal(tensor, expected[k]), (at, k)
            caught["packed"] += any(tensor is None for tensor in read.values())
        else:
            with pytest.raises(artifact.ArtifactError) as err:
                artifact.verify(copy)
            assert file.name in str(err.value) or "has format" in str(err.value), (file, at, str(err.value))
            caught["artifact"] += 1
        file.write_bytes(original)
    assert caught["artifact"] >= 150 and caught["packed"] >= 1
    artifact.verify(copy)
