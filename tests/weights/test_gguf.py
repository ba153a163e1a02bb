"""GGUF checkpoints: a file written here by the `gguf` package (tests/gguf_writer.py), its projections in
llama.cpp's quantized types, runs as the model its dequantized tensors make, with the config, tokenizer and
chat template of its metadata; transformers on those tensors is the oracle."""

import json
import logging
import struct

import numpy as np
import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.cli import main
from kiln.compiler.artifact import ArtifactMissing
from kiln.errors import KilnError
from kiln.models.demo import EOS_TOKEN, corpus, train_tokenizer
from kiln.weights.model_weights import ModelWeights
from tests.gguf_writer import CHAT_TEMPLATE, write_gguf
from tests.oracle import PROMPTS, hf_greedy

gguf = pytest.importorskip("gguf")

TYPES = {"q_proj": "Q8_0", "k_proj": "Q4_0", "v_proj": "Q4_1", "o_proj": "Q4_K", "gate_proj": "Q8_0",
         "up_proj": "Q4_K", "down_proj": "Q6_K", "embed_tokens": "Q8_0", "lm_head": "F16"}
"""Each kind of tensor in one of llama.cpp's types (norms and biases in F32, as its converter keeps them)."""


def type_of(name: str) -> str:
    kind = next((t for part, t in TYPES.items() if f"{part}.weight" in name), "F32")
    return kind


def _config(arch: str, vocab: int, eos: int):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-6,
                  bos_token_id=eos, eos_token_id=eos, initializer_range=0.05)
    if arch == "llama":  # untied, its query and key rows permuted in the file
        return LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0)
    if arch == "qwen2":  # qkv biases, tied
        return Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1000000.0)
    return Qwen3Config(**common, head_dim=32, tie_word_embeddings=True, rope_theta=1000000.0)  # q/k norms


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def gguf_model(request, tokenizer, tmp_path_factory):
    """(arch, the GGUF file, transformers holding the file's dequantized tensors)."""
    from transformers import AutoModelForCausalLM

    arch = request.param
    config = _config(arch, tokenizer.get_vocab_size(), tokenizer.token_to_id(EOS_TOKEN))
    torch.manual_seed(0)
    source = AutoModelForCausalLM.from_config(config).eval()
    path = tmp_path_factory.mktemp(f"gguf-{arch}") / f"tiny-{arch}.gguf"
    held = write_gguf(source, tokenizer, path, arch, type_of)
    reference = AutoModelForCausalLM.from_config(config).eval()
    missing = reference.load_state_dict(held, strict=False).missing_keys
    assert missing == (["lm_head.weight"] if config.tie_word_embeddings else [])
    if config.tie_word_embeddings:
        reference.tie_weights()
    return arch, path, reference


def test_a_gguf_file_runs_as_its_dequantized_tensors(gguf_model, tmp_path, caplog):
    arch, path, reference = gguf_model
    with caplog.at_level(logging.INFO, logger="kiln"):
        llm = LLM(path, cache_dir=tmp_path, quantization="none")
    config = llm.model_config
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.tie_word_embeddings) == \
        (2, 8, 2, arch != "llama")
    assert llm.model_name == path.name and llm.model_dir.parent == tmp_path / "gguf"
    # the load log names each stored type, and the ones dequantized
    assert "4 Q4_K (4 dequantized at load)" in caplog.text and "2 Q6_K (2 dequantized at load)" in caplog.text
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:4]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0))
    for prompt, out in zip(prompts, outs):
        tokens, logprobs = hf_greedy(reference, prompt, 8)
        assert out.token_ids == tokens
        np.testing.assert_allclose(out.logprobs, logprobs, atol=2e-4)


def test_the_tokenizer_and_chat_template_come_from_the_metadata(gguf_model, tokenizer, tmp_path):
    _, path, _ = gguf_model
    llm = LLM(path, cache_dir=tmp_path)
    for text in [*PROMPTS, corpus()[:2000]]:
        assert llm.tokenizer.encode(text) == tokenizer.encode(text).ids
    assert llm.tokenizer.chat_template == CHAT_TEMPLATE
    assert llm.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}]) == "<|user|>Hi\n<|assistant|>"
    again = LLM(path, cache_dir=tmp_path)  # the view is found again, not written twice
    assert again.model_dir == llm.model_dir and len(list((tmp_path / "gguf").iterdir())) == 1
    written = (llm.model_dir / "tokenizer.json").read_bytes()
    (llm.model_dir / "tokenizer.json").write_bytes(written.replace(b'"merges"', b'"mergez"'))  # damaged in the cache
    healed = LLM(path, cache_dir=tmp_path)  # its checksum fails: the view is written again, not read
    assert (healed.model_dir / "tokenizer.json").read_bytes() == written
    assert healed.tokenizer.encode(PROMPTS[0]) == tokenizer.encode(PROMPTS[0]).ids


def test_the_views_config_is_transformers_gguf_loaders(gguf_model, tmp_path):
    """kiln reads the metadata itself (transformers' reader takes ~10 s over a real vocabulary) and names the
    fields by transformers' table: the config is the one transformers' own GGUF loader gives."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    arch, path, _ = gguf_model
    want = {k: v for k, v in load_gguf_checkpoint(str(path), return_tensors=False)["config"].items()
            if not k.startswith("_")}
    got = json.loads((LLM(path, cache_dir=tmp_path).model_dir / "config.json").read_text())
    assert {k: got[k] for k in want} == want
    assert got["num_hidden_layers"] == 2 and got["eos_token_id"] == want["eos_token_id"]


def _metadata_only(path, arch: str, tensors: dict) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for name, (data, kind) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_files_kiln_cannot_run_are_refused_by_name(tmp_path):
    other = tmp_path / "phi.gguf"
    _metadata_only(other, "phi3", {"token_embd.weight": (np.zeros((4, 32), np.float32), None)})
    with pytest.raises(KilnError, match="phi.gguf is a phi3 model; kiln runs GGUF files of llama, mistral"):
        LLM(other, cache_dir=tmp_path)
    shapeless = tmp_path / "shapeless.gguf"  # a llama whose metadata says nothing of its hidden size
    _metadata_only(shapeless, "llama", {"token_embd.weight": (np.zeros((4, 32), np.float32), None)})
    with pytest.raises(KilnError, match="shapeless.gguf: its metadata lacks llama.feed_forward_length, "
                                        "llama.embedding_length, llama.attention.head_count, llama.vocab_size"):
        LLM(shapeless, cache_dir=tmp_path)
    ints = tmp_path / "ints.gguf"
    _metadata_only(ints, "llama", {"token_embd.weight": (np.zeros((4, 32), np.int32), gguf.GGMLQuantizationType.I32)})
    from kiln.weights.gguf_file import GgufFile

    with pytest.raises(KilnError, match="tensor 'token_embd.weight' in ints.gguf is I32, a type kiln does not read"):
        GgufFile(ints)
    huge = tmp_path / "huge.gguf"  # a header string that claims 2^62 bytes: refused, nothing allocated
    huge.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1 << 62) + b"x" * 64)
    with pytest.raises(KilnError, match="huge.gguf is not a readable GGUF file .*past the end of the file"):
        LLM(huge, cache_dir=tmp_path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(KilnError, match="junk.gguf is not a readable GGUF file"):
        LLM(junk, cache_dir=tmp_path)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(KilnError, match="is a file: kiln runs a Hugging Face model directory .* or a .gguf file"):
        LLM(text, cache_dir=tmp_path)


Q4 = {"q_proj": "Q4_0", "k_proj": "Q4_1", "v_proj": "Q4_0", "o_proj": "Q4_1", "gate_proj": "Q4_0", "up_proj": "Q4_K",
      "down_proj": "Q4_0"}


def test_q4_0_q4_1_and_q4_k_codes_are_kiln_int4_as_stored(tokenizer, tmp_path, caplog, capsys):
    """A Q4_0 or Q4_1 projection's codes, scales and minimums are kiln's int4 format unchanged (a llama's, permuted
    in the file, back in order), a Q4_K one's with its scale and minimum products rounded to fp16: a file of them
    runs as int4 unless told otherwise, its weights the file's."""
    from transformers import AutoModelForCausalLM

    from kiln.kernels.quant import dequantize_int4
    from kiln.weights.loader import _sources

    config = _config("llama", tokenizer.get_vocab_size(), tokenizer.token_to_id(EOS_TOKEN))
    torch.manual_seed(1)
    path = tmp_path / "q4.gguf"
    held = write_gguf(AutoModelForCausalLM.from_config(config), tokenizer, path, "llama",
                      lambda name: next((t for p, t in Q4.items() if f"{p}.weight" in name), type_of(name)))
    with caplog.at_level(logging.INFO, logger="kiln"):
        llm = LLM(path, cache_dir=tmp_path)  # a file of Q4_0 and Q4_1 projections runs them as int4 by default
    assert llm.quantization == "int4" and "q4.gguf holds its projections quantized: they run as kiln's int4, " \
        "kiln's int4 codes as stored (Q4_0, Q4_1, Q4_K)" in caplog.text
    assert "8 Q4_0 (8 as kiln int4 codes unchanged)" in caplog.text
    assert "4 Q4_1 (4 as kiln int4 codes unchanged)" in caplog.text
    assert "2 Q4_K (2 as kiln int4 codes, scales rounded to fp16)" in caplog.text
    assert ModelWeights(llm.model_dir).stored_types() == {"F16": 1, "F32": 5, "Q4_0": 8, "Q4_1": 4, "Q4_K": 2, "Q8_0": 1}
    params = dict(llm.model.named_parameters())
    checked = 0
    for pname, param in params.items():
        if param.dtype != torch.uint8:
            continue
        base = pname.removesuffix(".weight")
        weights = dequantize_int4(param, params[base + ".weight_scale"], params[base + ".weight_min"])
        sources = [name for name, _, _ in _sources(llm.model, pname, param)]
        want = torch.cat([held[name] for name in sources])
        if any("up_proj" in name for name in sources):  # Q4_K's d x sc and dmin x m, each rounded to fp16
            assert not torch.equal(weights, want)
            torch.testing.assert_close(weights, want, rtol=0, atol=16 * 2e-4 * 63 * 2**-11)
        else:
            assert torch.equal(weights, want), pname
        checked += 1
    assert checked == 2 * 4  # qkv, o, gate_up, down in each of 2 layers
    full = LLM(path, cache_dir=tmp_path, quantization="none")  # dequantized at load, as asked
    assert full.quantization is None and all(p.dtype == torch.float32 for p in full.model.parameters())
    # `kiln compile FILE.gguf` keys the same artifact as the LLM that runs it looks for: the same default scheme
    for asked in ([], ["--quantization", "none"]):
        assert main(["cache", "explain", "--model", str(path), "--cache-dir", str(tmp_path), "--json", *asked]) == 0
        key = json.loads(capsys.readouterr().out)["key"]
        with pytest.raises(ArtifactMissing, match=key):
            LLM(path, cache_dir=tmp_path, require_artifact=True, quantization=asked[1] if asked else None)


def test_a_quantized_file_runs_in_the_scheme_nearest_its_types(gguf_model, tokenizer, tmp_path):
    """Unless asked: q8_0 where most projection weights are Q8_0, with Q8_0's and Q5_0's codes and scales as the
    file holds them (a llama's q/k rows back in order); int4 for a mix of 4- to 6-bit types (the K-quant mixes);
    as stored for Q4_0/Q4_1/Q4_K alone (above); floating point where a projection is."""
    from transformers import AutoModelForCausalLM

    from kiln.weights.loader import _sources

    _, mixed, _ = gguf_model
    view = ModelWeights.directory(mixed, tmp_path)
    assert ModelWeights(view).stored_quantization() == (
        "int4", "Q4_0, Q4_1, Q4_K, Q6_K, Q8_0, requantized to int4 in groups of 32 where not Q4_0, Q4_1 or Q4_K")
    config = _config("llama", tokenizer.get_vocab_size(), tokenizer.token_to_id(EOS_TOKEN))
    path = tmp_path / "q8.gguf"
    held = write_gguf(AutoModelForCausalLM.from_config(config), tokenizer, path, "llama",
                      lambda name: "Q5_0" if "k_proj" in name else "Q8_0" if "_proj" in name else type_of(name))
    llm = LLM(path, cache_dir=tmp_path)
    assert llm.quantization == "q8_0" and ModelWeights(llm.model_dir).stored_quantization()[1] == \
        "kiln's q8_0 codes as stored (Q5_0, Q8_0)"
    params = dict(llm.model.named_parameters())
    checked = 0
    for pname, param in params.items():
        if param.dtype != torch.int8:
            continue
        scales = params[pname.removesuffix(".weight") + ".weight_scale"]
        weights = (param.float().view(param.shape[0], -1, 32) * scales.float()[..., None]).view(param.shape)
        assert torch.equal(weights, torch.cat([held[name] for name, _, _ in _sources(llm.model, pname, param)]))
        checked += 1
    assert checked == 2 * 4
    six = tmp_path / "six.gguf"  # Q6_K beside Q8_0: requantized in groups of 32
    write_gguf(AutoModelForCausalLM.from_config(config), tokenizer, six, "llama",
               lambda name: "Q6_K" if "down_proj" in name else "Q8_0" if "_proj" in name else type_of(name))
    assert ModelWeights(ModelWeights.directory(six, tmp_path)).stored_quantization() == \
        ("q8_0", "kiln's q8_0 codes as stored (Q6_K, Q8_0; Q6_K requantized in groups of 32)")
    half = tmp_path / "half.gguf"  # a file with a projection in floating point runs in floating point
    write_gguf(AutoModelForCausalLM.from_config(config), tokenizer, half, "llama",
               lambda name: "F16" if "down_proj" in name else "Q8_0" if "_proj" in name else type_of(name))
    assert ModelWeights(ModelWeights.directory(half, tmp_path)).stored_quantization() is None
