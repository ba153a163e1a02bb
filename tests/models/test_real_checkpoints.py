"""What a user's first real checkpoint needs: its own dtype, loading without a second copy in
memory, sharded files, a memory check before loading and a KV cache sized to the machine."""

import json
import re
import logging
import shutil
import struct
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln import LLM, SamplingParams
from kiln.errors import KilnError
from kiln.models.config import ModelConfig
from kiln.runtime.kv_cache import bytes_per_block
from kiln.runtime.memory import MemoryPlan, activation_bytes, available_bytes
from kiln.weights.model_weights import ModelWeights
from tests.oracle import PROMPTS, hf_greedy
from tests.processes import REPO

QWEN_05B = {  # Qwen2.5-0.5B's shape
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
    "hidden_act": "silu", "torch_dtype": "bfloat16",
}


def _bf16_copy(src, dst):
    """The demo model as a bf16 checkpoint (config.json says so)."""
    shutil.copytree(src, dst)
    tensors = {k: v.to(torch.bfloat16) for k, v in load_file(dst / "model.safetensors").items()}
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config.pop("dtype", None)
    (dst / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    return dst


def test_dtype_auto_runs_the_checkpoints_dtype(demo_dirs, tmp_path):
    bf16 = _bf16_copy(demo_dirs["llama"], tmp_path / "bf16")
    auto = LLM(bf16, kv_cache_memory_bytes=1 << 24)
    assert auto.dtype == "bfloat16" and auto.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert "running in bfloat16 (the checkpoint's" in auto.dtype_note
    assert LLM(bf16, dtype="float32", kv_cache_memory_bytes=1 << 24).model.model.embed_tokens.weight.dtype == torch.float32
    assert LLM(demo_dirs["llama"], kv_cache_memory_bytes=1 << 24).dtype == "float32"  # the demo is saved in fp32
    with pytest.raises(KilnError, match="unknown dtype 'float64'"):
        LLM(bf16, dtype="float64")


def test_a_sharded_checkpoint_generates_as_transformers_does(demo_dirs, hf_models, tmp_path):
    sharded = tmp_path / "sharded"
    hf_models["llama"].save_pretrained(sharded, max_shard_size="300KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (demo_dirs["llama"] / name).exists():
            shutil.copy(demo_dirs["llama"] / name, sharded / name)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3
    llm = LLM(sharded, kv_cache_memory_bytes=1 << 24)
    for prompt in PROMPTS[:3]:
        ids = llm.tokenizer.encode(prompt)
        want, _ = hf_greedy(hf_models["llama"], ids, 12)
        assert llm.generate([ids], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids == want


_PEAK = """
import sys
from kiln import LLM
def status(field):  # VmHWM, not ru_maxrss: that one keeps the parent's peak across fork and exec
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
before = status("VmRSS")
llm = LLM(sys.argv[1], kv_cache_memory_bytes=1 << 24)
peak = status("VmHWM")
print(before, peak, llm.dtype)
"""


def test_loading_a_bf16_checkpoint_holds_it_once(tmp_path):
    """A ~1 GB bf16 checkpoint of Qwen2.5-0.5B's shape, loaded in a fresh process: the resident memory
    loading adds peaks at no more than 1.3x the checkpoint's bytes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = tmp_path / "qwen"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(QWEN_05B))
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
                  .state_dict().items() if k != "lm_head.weight"}
    gen = torch.Generator().manual_seed(0)
    save_file({k: torch.randn(s, generator=gen).to(torch.bfloat16) for k, s in shapes.items()},
              model_dir / "model.safetensors")
    size = (model_dir / "model.safetensors").stat().st_size
    assert 0.9e9 < size < 1.1e9
    out = subprocess.run([sys.executable, "-c", _PEAK, str(model_dir)], capture_output=True, text=True, timeout=600,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    before, peak, dtype = out.stdout.split()
    assert dtype == "bfloat16"
    added = int(peak) - int(before)
    assert added <= 1.3 * size, f"loading took {added / 1e9:.2f} GB for a {size / 1e9:.2f} GB checkpoint"


def _sparse_checkpoint(model_dir, vocab: int, hidden: int):
    """A config whose embedding alone is `vocab` x `hidden` bf16, in a sparse file: the header is real,
    the data a hole (nothing reads it: the memory check comes first)."""
    model_dir.mkdir()
    config = {**QWEN_05B, "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": 1}
    (model_dir / "config.json").write_text(json.dumps(config))
    nbytes = vocab * hidden * 2
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "BF16", "shape": [vocab, hidden],
                                                       "data_offsets": [0, nbytes]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(model_dir / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        f.truncate(8 + len(header) + nbytes)
    return nbytes


def test_a_model_too_large_for_memory_fails_before_loading_with_the_numbers(tmp_path):
    hidden = 2 * 4096  # bfloat16 weights of 0.7x the memory available: only in float32 do they not fit
    nbytes = _sparse_checkpoint(tmp_path / "huge", vocab=int(0.7 * available_bytes(torch.device("cpu"))) // (2 * hidden),
                                hidden=hidden)
    assert nbytes * 2 > available_bytes(torch.device("cpu"))
    with pytest.raises(KilnError) as err:
        LLM(tmp_path / "huge", dtype="float32")
    message = str(err.value)
    assert "does not fit" in message and "of weights in float32" in message and re.search(r"but [0-9.]+G is available", message)
    assert "--dtype bfloat16" in message and "\n" not in message
    proc = subprocess.run([sys.executable, "-m", "kiln", "generate", str(tmp_path / "huge"), "--prompt", "x",
                           "--dtype", "float32"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 1 and "does not fit" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) <= 2  # the dtype line, then the error


def test_a_long_context_model_starts_with_max_model_len_capped(demo_dirs, tmp_path, caplog):
    long = tmp_path / "long"
    shutil.copytree(demo_dirs["llama"], long)
    config = json.loads((long / "config.json").read_text())
    (long / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 131072}))
    cfg = ModelConfig.from_model_dir(long)
    budget = 64 << 20  # for the KV cache, once activations are set aside: 16k tokens of this model
    share = (budget + activation_bytes(cfg, 2048, 64)) / available_bytes(torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="kiln"):
        llm = LLM(long, memory_utilization=share)  # the KV cache sized from the memory available
    per_token = bytes_per_block(cfg, 1, torch.float32)
    assert 0.8 * budget <= llm.engine.max_model_len * per_token <= 1.2 * budget
    assert f"max_model_len capped to {llm.engine.max_model_len} tokens" in caplog.text
    out = llm.generate(["The kiln was"], SamplingParams(max_tokens=4, temperature=0))[0]
    assert len(out.token_ids) == 4
    with pytest.raises(KilnError, match="does not fit") as refused:  # asked for explicitly: refused
        LLM(long, memory_utilization=share, max_model_len=131072)
    fit = int(re.search(r"--max-model-len (\d+) or less", str(refused.value))[1])
    assert 0.7 * budget <= fit * per_token <= 1.2 * budget
    assert "--dtype bfloat16" not in str(refused.value)  # half of 131072 tokens does not fit either: not offered
    assert LLM(long, memory_utilization=share, max_model_len=fit).engine.max_model_len == fit  # the one offered fits


def test_a_kv_cache_asked_for_is_checked_as_given():
    """An explicit KV-cache size takes that many bytes: the utilization share applies to the automatic size
    only (17G asked for was refused where the automatic size came to 17.3G)."""
    G = 2**30
    given = MemoryPlan(weights=10 * G, activations=G, kv_min=18 * G, available=30 * G, utilization=0.9, kv_given=True)
    assert given.fits and given.kv_room == 19 * G
    automatic = MemoryPlan(weights=10 * G, activations=G, kv_min=18 * G, available=30 * G, utilization=0.9)
    assert not automatic.fits and automatic.kv_room == 17 * G


def test_a_context_that_cannot_be_is_refused_before_loading(demo_dirs, monkeypatch):
    """A max_model_len past the model's, or a KV cache asked for too small to hold one: refused before any
    weight is read."""
    monkeypatch.setattr(ModelWeights, "load_into", lambda *args: pytest.fail("loaded the weights first"))
    per_token = bytes_per_block(ModelConfig.from_model_dir(demo_dirs["llama"]), 1, torch.float32)
    with pytest.raises(KilnError, match="max_model_len 4096 exceeds the model's max_position_embeddings 2048: give "
                                        "--max-model-len 2048 or less"):
        LLM(demo_dirs["llama"], max_model_len=4096)
    with pytest.raises(KilnError, match="holds 592 tokens, less than max_model_len 1024"):
        LLM(demo_dirs["llama"], kv_cache_memory_bytes=600 * per_token, max_model_len=1024)
