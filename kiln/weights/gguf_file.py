"""GGUF checkpoints (llama.cpp's one-file format) read with the `gguf` package, under Hugging Face's names.

A GGUF file holds the weights, the config and the tokenizer together. `model_view` turns its metadata
into a model directory in the cache (config.json from kiln's own header reader, named by transformers'
table of GGUF keys; the tokenizer and its chat template through transformers' GGUF tokenizer; and a link
to the file), so the rest of kiln reads it as any other model
directory. `GgufFile` reads its tensors by Hugging Face name, with the interface of `SafetensorsFile`.

Quantized tensors are dequantized while loading, one tensor at a time (`gguf.quants`, vectorized numpy),
to the model dtype or, with `--quantization`, on to kiln's own formats; the load log names each type so
handled. llama.cpp stores a llama's query and key rows permuted for its rope; reading undoes that.
"""

import hashlib
import json
import logging
import math
import os
import shutil
import struct
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from kiln import checksum
from kiln.errors import KilnError

logger = logging.getLogger(__name__)

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}
"""`general.architecture` values kiln runs, and the Hugging Face architecture each becomes."""

PERMUTED = ("llama", "mistral")
"""Architectures whose query and key rows llama.cpp's converter permutes (its `LlamaModel.permute`)."""

LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
"""A layer's GGUF tensor names (`blk.N.<name>.weight|bias`) and their Hugging Face modules."""

MODEL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}

VIEW_DIGESTS = "view.json"
"""A model view's file of its files' checksums (`kiln.checksum`), checked before the view is used again."""

FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
"""GGUF tensor types read as they are stored; every other type kiln reads is dequantized to fp32."""

DEQUANTIZED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
"""The quantized types read (dequantized at load, unless `EXACT_INT4` holds them as stored)."""

EXACT_INT8 = {"Q8_0": 34, "Q5_0": 22}
"""Types whose codes kiln's q8_0 format (int8, an fp16 scale per 32) holds as they are, and their block's bytes."""
EXACT_INT4 = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144}
"""Types whose codes kiln's int4 format holds as they are (`--quantization int4`), and their block's bytes."""

def hf_name(name: str) -> str | None:
    """The Hugging Face name of GGUF tensor `name` (None: not a tensor of the architectures kiln runs)."""
    parts = name.split(".")
    if len(parts) == 2 and parts[0] in MODEL_TENSORS:
        return f"{MODEL_TENSORS[parts[0]]}.{parts[1]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{LAYER_TENSORS[parts[2]]}.{parts[3]}"
    return None


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
"""GGUF metadata value types of fixed size, as `struct` formats (8 is a string, 9 an array)."""


class _Header:
    """A GGUF file's metadata and tensor table, parsed from its first bytes.

    Why not `gguf.GGUFReader`: it builds a numpy view per element of every array, which takes seconds for a
    vocabulary's 50,000 tokens and merges at every start; this reads them as plain values in one pass."""

    def __init__(self, path: Path):
        self.path = path
        self.size = path.stat().st_size
        with open(path, "rb") as f:
            self._buf, self._pos = f.read(1 << 20), 0
            self._file = f
            try:
                if self._take(4) != b"GGUF":
                    raise ValueError("no GGUF magic number")
                version, tensors, count = struct.unpack("<IQQ", self._take(20))
                if version not in (2, 3):
                    raise ValueError(f"GGUF version {version}; kiln reads versions 2 and 3")
                self.fields = {}
                for _ in range(count):
                    key = self._string()
                    self.fields[key] = self._value(self._u32())
                self.tensors = {}
                for _ in range(tensors):
                    name = self._string()
                    n_dims = self._u32()
                    dims = struct.unpack(f"<{n_dims}Q", self._take(8 * n_dims))
                    kind, offset = struct.unpack("<IQ", self._take(12))
                    self.tensors[name] = (dims, kind, offset)
            except (ValueError, struct.error, UnicodeDecodeError, EOFError) as e:
                raise KilnError(f"{path} is not a readable GGUF file ({e})") from None
        align = int(self.fields.get("general.alignment", 32))
        self.data_start = -(-self._pos // align) * align

    def _take(self, n: int) -> bytes:
        if self._pos + n > self.size:  # a length no file this size holds: refused before any allocation
            raise EOFError(f"the header asks for {n} bytes at {self._pos}, past the end of the file")
        while self._pos + n > len(self._buf):  # the header is longer than what was read: read on
            more = self._file.read(max(n, len(self._buf)))
            if not more:
                raise EOFError("the file ends inside its header")
            self._buf += more
        out = self._buf[self._pos:self._pos + n]
        self._pos += n
        return out

    def _u32(self) -> int:
        return struct.unpack("<I", self._take(4))[0]

    def _string(self) -> str:
        (n,) = struct.unpack("<Q", self._take(8))
        return self._take(n).decode()

    def _value(self, kind: int):
        if kind in _SCALARS:
            fmt = _SCALARS[kind]
            return struct.unpack(fmt, self._take(struct.calcsize(fmt)))[0]
        if kind == 8:
            return self._string()
        if kind == 9:
            (inner,) = struct.unpack("<I", self._take(4))
            (n,) = struct.unpack("<Q", self._take(8))
            if inner in _SCALARS:
                fmt = _SCALARS[inner]
                return list(struct.unpack(f"<{n}{fmt[1]}", self._take(n * struct.calcsize(fmt))))
            return [self._value(inner) for _ in range(n)]
        raise ValueError(f"unknown metadata value type {kind}")

    def header_bytes(self) -> bytes:
        """The metadata and tensor table as stored: what names the file's model view."""
        return self._buf[:self._pos]


def _architecture(header: _Header) -> str:
    arch = header.fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise KilnError(f"{header.path.name} is a {arch or 'GGUF file of no stated'} model; kiln runs GGUF files "
                        f"of {', '.join(ARCHITECTURES)}")
    return arch


class GgufFile:
    """One GGUF file's tensors by Hugging Face name, read (and dequantized) one at a time; use as a context
    manager, as `SafetensorsFile`."""

    def __init__(self, path: str | Path):
        try:
            from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        except ImportError:
            raise KilnError("reading a GGUF file needs the `gguf` package: pip install gguf") from None
        self.path = Path(path)
        header = _Header(self.path)
        self.architecture = _architecture(header)
        self._heads = (header.fields.get(f"{self.architecture}.attention.head_count"),
                       header.fields.get(f"{self.architecture}.attention.head_count_kv"))
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._tensors: dict[str, tuple] = {}
        for gguf_name, (dims, kind, offset) in header.tensors.items():
            name = hf_name(gguf_name)
            if name is None:
                if gguf_name == "rope_freqs.weight":
                    raise KilnError(f"{self.path.name} scales its rope by a `rope_freqs` tensor (llama 3.1's "
                                    "scaling), which kiln does not read from GGUF yet")
                raise KilnError(f"{self.path.name} has tensor {gguf_name!r}, which no {self.architecture} "
                                "model kiln runs has")
            try:
                qtype = GGMLQuantizationType(kind)
            except ValueError:
                raise KilnError(f"tensor {gguf_name!r} in {self.path.name} has type {kind}, which the gguf "
                                "package does not know") from None
            if qtype.name not in FLOAT_TYPES and qtype.name not in DEQUANTIZED:
                raise KilnError(f"tensor {gguf_name!r} in {self.path.name} is {qtype.name}, a type kiln does not "
                                f"read (it reads {', '.join([*FLOAT_TYPES, *DEQUANTIZED])})")
            block, block_bytes = GGML_QUANT_SIZES[qtype]
            shape = [int(n) for n in reversed(dims)]  # GGUF lists the fastest dimension first
            if shape[-1] % block:
                raise KilnError(f"tensor {gguf_name!r} in {self.path.name} has rows of {shape[-1]} values, not "
                                f"whole {qtype.name} blocks of {block}")
            begin = header.data_start + offset
            end = begin + math.prod(shape[:-1]) * shape[-1] // block * block_bytes
            if end > header.size:
                raise KilnError(f"{self.path} is truncated: tensor {gguf_name!r} runs past the end of the file "
                                "(an interrupted download?)")
            self._tensors[name] = (shape, qtype, begin, end)
        self.types = Counter(t[1].name for t in self._tensors.values())
        """How many tensors of each GGUF type the file holds (e.g. {"Q4_K": 120, "F32": 61})."""
        self.digests: dict[str, bytes] = {}
        """The checksum (`kiln.checksum`) of each tensor's stored bytes read, by name: the loaded contents' identity."""
        self.exact: set[str] = set()
        """The tensors read as kiln int4 or q8_0 codes (`int4_codes`, `int8_codes`), not dequantized."""

    def keys(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> list[int]:
        return list(self._tensors[name][0])

    def dtype(self, name: str) -> torch.dtype:
        return FLOAT_TYPES.get(self.stored_type(name), torch.float32)

    def stored_type(self, name: str) -> str:
        return self._tensors[name][1].name

    def numel(self, name: str) -> int:
        return math.prod(self.shape(name))

    def tensor(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `name` (or only `rows` = (start, count) of its first dimension) in a new tensor: as stored for
        float types, else dequantized to fp32; a llama's query and key rows back in Hugging Face's order."""
        from gguf import quants

        shape, qtype, begin, end = self._tensors[name]
        stored = self._map[begin:end]
        self.digests[name] = checksum.digest(memoryview(stored))
        if qtype.name in FLOAT_TYPES:
            dtype = FLOAT_TYPES[qtype.name]
            values = torch.frombuffer(bytearray(stored), dtype=dtype).reshape(shape)
        else:
            values = torch.from_numpy(quants.dequantize(stored.reshape(math.prod(shape[:-1]), -1), qtype))
            values = values.reshape(shape)
        if self.architecture in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.bias",
                                                            "k_proj.bias")):
            values = _unpermute(values, self._heads[0] if ".q_proj." in name else self._heads[1])
        return values if rows is None else values[rows[0]:rows[0] + rows[1]].clone()

    def int4_codes(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A Q4_0, Q4_1 or Q4_K tensor's codes as kiln's int4 format holds them: (codes [N, K / 2] uint8 in
        `pack_nibbles`' order, scales and minimums [N, K / 32] fp16), each weight scale x code + min. Q4_0's
        d x (q - 8) is a minimum of -8 d and Q4_1's d x q + m are exact in fp16; Q4_K's d x sc x q - dmin x m
        has its two products per 32 weights rounded to fp16 (a relative 2^-11 of a scale). None for any other
        type."""
        blocks = self._exact_blocks(name, EXACT_INT4)
        if blocks is None:
            return None
        codes, scales, mins = _INT4_BLOCKS[self.stored_type(name)](blocks)
        codes = codes.reshape(self.shape(name)[0], -1)
        return self._rows(name, codes[:, 0::2] | (codes[:, 1::2] << 4), scales, mins)

    def int8_codes(self, name: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A Q8_0 or Q5_0 tensor's codes as kiln's q8_0 format holds them, unchanged: (codes [N, K] int8, scales
        [N, K / 32] fp16), each weight scale x code (Q5_0's d x (q - 16)). None for any other type."""
        blocks = self._exact_blocks(name, EXACT_INT8)
        if blocks is None:
            return None
        scales = blocks[:, 0:2].copy().view(np.float16)[:, 0]
        if self.stored_type(name) == "Q8_0":
            codes = blocks[:, 2:].copy().view(np.int8)
            if (codes == -128).any():  # llama.cpp's quantizer writes -127..127; kiln's kernels take no -128
                logger.warning("%s: %s holds Q8_0 codes of -128, read as -127", self.path.name, name)
                np.maximum(codes, -127, out=codes)
        else:  # 16 bytes of low nibbles (values 0-15 low, 16-31 high) and a 32-bit word of fifth bits
            high = blocks[:, 2:6].copy().view(np.uint32)
            fifth = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
            qs = blocks[:, 6:]
            codes = (np.concatenate([qs & 0x0F, qs >> 4], axis=1) | fifth).astype(np.int8) - np.int8(16)
        return self._rows(name, codes, scales)

    def _exact_blocks(self, name: str, types: dict[str, int]) -> np.ndarray | None:
        """Tensor `name`'s stored blocks [blocks, bytes] where its type is one of `types` (type -> a block's bytes),
        checksummed and counted as read exactly; else None."""
        shape, qtype, begin, end = self._tensors[name]
        if qtype.name not in types:
            return None
        stored = np.asarray(self._map[begin:end])
        self.digests[name] = checksum.digest(memoryview(stored))
        self.exact.add(name)
        return stored.reshape(-1, types[qtype.name])

    def _rows(self, name: str, *parts: np.ndarray) -> tuple[torch.Tensor, ...]:
        """The parts of tensor `name` read exactly (codes, scales, ...), each as [rows, -1] tensors in Hugging Face's
        row order (a llama's query and key rows un-permuted)."""
        rows = self.shape(name)[0]
        out = [torch.from_numpy(np.ascontiguousarray(part.reshape(rows, -1))) for part in parts]
        if self.architecture in PERMUTED and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self._heads[0] if ".q_proj." in name else self._heads[1]
            out = [_unpermute(t, heads) for t in out]
        return tuple(out)

    def read_into(self, name: str, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Read tensor `name` (or `rows` of it) into `out`, a tensor of its dtype and shape."""
        out.copy_(self.tensor(name, rows).reshape(out.shape))

    def summary(self) -> str:
        """The tensors read, by stored type, and how each was held (for the load log)."""
        parts = []
        for kind, count in sorted(self.types.items()):
            exact = sum(1 for n in self.exact if self.stored_type(n) == kind)
            held = "kiln int4 codes, scales rounded to fp16" if kind == "Q4_K" else \
                "kiln q8_0 codes unchanged" if kind in EXACT_INT8 else "kiln int4 codes unchanged"
            how = [f"{exact} as {held}"] if exact else []
            if kind not in FLOAT_TYPES and count > exact:
                how.append(f"{count - exact} dequantized at load")
            parts.append(f"{count} {kind}" + (f" ({', '.join(how)})" if how else ""))
        return ", ".join(parts)

    def close(self) -> None:
        self._tensors, self._map = {}, None

    def __enter__(self) -> "GgufFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's rope permutation of a query or key projection's rows (each head's two halves
    interleaved), for `heads` heads."""
    shape = w.shape
    return w.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).transpose(1, 2).reshape(shape)


def _q4_0_q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_0/Q4_1 blocks of 32 as (codes 0..15 [blocks, 32] in weight order, scales, minimums [blocks] fp16)."""
    scales = blocks[:, 0:2].copy().view(np.float16)[:, 0]
    mins = blocks[:, 2:4].copy().view(np.float16)[:, 0] if blocks.shape[1] == 20 else scales * np.float16(-8)
    qs = blocks[:, -16:]
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1), scales, mins  # 16 bytes: values 0-15 low, 16-31 high


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks of 256 as (codes 0..15 [blocks, 256] in weight order, scales and minimums [blocks, 8]
    fp16): 8 groups of 32, each d x sc its scale and -dmin x m its minimum (6-bit sc and m, fp16 d and dmin)."""
    from gguf import quants

    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = quants.Q4_K.get_scale_min(blocks[:, 4:16])
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32)  # 4 x 32 bytes: group 2j in the low nibbles, 2j + 1 in the high
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 256)
    return codes, (d * sc).astype(np.float16), (-(dmin * m)).astype(np.float16)


_INT4_BLOCKS = {"Q4_0": _q4_0_q4_1, "Q4_1": _q4_0_q4_1, "Q4_K": _q4_k}


def _view_key(path: Path, header: _Header) -> str:
    """The view's name: the file's path and its whole header (metadata and tensor table), hashed."""
    return hashlib.sha256(str(path).encode() + b"\0" + header.header_bytes()).hexdigest()[:32]


def model_view(path: str | Path, cache_dir: Path) -> Path:
    """A model directory for GGUF file `path`: config.json, the tokenizer files and a link to the file,
    written once into `cache_dir`/gguf (atomically) and found again by the file's path and header; its files'
    checksums are checked each time, and a damaged view is written again."""
    path = Path(path).resolve()
    header = _Header(path)
    arch = _architecture(header)
    view = Path(cache_dir) / "gguf" / _view_key(path, header)
    if _intact(view) and (view / path.name).exists():
        return view
    if view.exists():
        logger.warning("GGUF %s: its model view in %s is damaged; writing it again", path.name, view)
        shutil.rmtree(view, ignore_errors=True)
    view.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".view-", dir=view.parent))
    try:
        _write_view(path, header, arch, tmp)
        digests = {f.name: checksum.digest(f.read_bytes()).hex() for f in sorted(tmp.iterdir())}
        (tmp / VIEW_DIGESTS).write_text(json.dumps(digests))
        os.symlink(path, tmp / path.name)
        try:
            tmp.rename(view)
        except OSError:  # another process wrote it first: theirs is the same
            if not _intact(view):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("GGUF %s: model view in %s", path.name, view)
    return view


def _intact(view: Path) -> bool:
    """Whether every file of a model view (config, tokenizer) still has the checksum it was written with."""
    try:
        digests = json.loads((view / VIEW_DIGESTS).read_text())
        return "config.json" in digests and "tokenizer.json" in digests and all(
            checksum.digest((view / name).read_bytes()).hex() == digest for name, digest in digests.items())
    except (OSError, ValueError, AttributeError):
        return False


def _config(header: _Header, arch: str) -> dict:
    """config.json's fields from the file's metadata, named by transformers' own table of GGUF keys: what its
    GGUF loader gives (`load_gguf_checkpoint`), without the ~10 s its reader takes over a vocabulary's arrays."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    names = GGUF_CONFIG_MAPPING[arch]
    tables = {arch: names, "tokenizer": GGUF_CONFIG_MAPPING.get("tokenizer", {})}  # the shape; special tokens' ids
    config = {}
    for key, value in header.fields.items():
        prefix, _, field = key.partition(".")
        name = tables.get(prefix, {}).get(field)
        if name:
            config[name] = value
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in header.fields:
        config["vocab_size"] = len(header.fields["tokenizer.ggml.tokens"])
    missing = [f"{arch}.{field}" for field, name in names.items() if name in REQUIRED_CONFIG and name not in config]
    if missing:
        raise KilnError(f"{header.path.name}: its metadata lacks {', '.join(missing)}, which the model's shape needs")
    return config


REQUIRED_CONFIG = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
"""The config fields a model cannot be built without; the rest have defaults."""


def _write_view(path: Path, header: _Header, arch: str, out: Path) -> None:
    """config.json from the GGUF's metadata, and the tokenizer files through transformers' GGUF tokenizer."""
    from transformers import AutoTokenizer

    config = _config(header, arch)
    config["architectures"] = [ARCHITECTURES[arch]]
    config["model_type"] = arch
    config.setdefault("torch_dtype", "float32")
    with GgufFile(path) as f:
        config["tie_word_embeddings"] = "lm_head.weight" not in f
        float_types = {f.stored_type(n) for n in f.keys() if n.endswith("_proj.weight")} & set(FLOAT_TYPES)
    if float_types == {"BF16"}:  # F16 runs in fp32, as llama.cpp computes it
        config["torch_dtype"] = "bfloat16"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except (ValueError, KeyError, NotImplementedError) as e:
        raise KilnError(f"{path.name}: transformers cannot build its tokenizer ({e})") from None
    tokenizer.save_pretrained(str(out))
