"""Which files hold a model directory's weights, and the reader for each: safetensors (one file or shards
with an index) or one GGUF file (a GGUF model's view directory links it, `kiln.weights.gguf_file`)."""

import json
from collections import Counter
from pathlib import Path

from kiln.errors import KilnError
from kiln.weights.gguf_file import GgufFile
from kiln.weights.safetensors_file import SafetensorsFile

PROJECTION_WEIGHTS = tuple(f".{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                       "down_proj", "w1", "w2", "w3"))
"""A decoder's projection weights (Hugging Face's names; w1, w2, w3: Mixtral's experts'): what `--quantization`
quantizes."""

INDEX_FILE = "model.safetensors.index.json"
"""A sharded checkpoint's map of tensor names to files."""


def checkpoint_files(model_dir: Path) -> list[Path]:
    """A checkpoint's files: the safetensors files its index lists, else every one in `model_dir`, else its
    one GGUF file."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise KilnError(f"{index} lists {', '.join(missing)}, which is not in {model_dir}")
        return files
    files = sorted(model_dir.glob("*.safetensors")) or sorted(model_dir.glob("*.gguf"))
    if not files:
        raise KilnError(f"{model_dir} has no *.safetensors weights (kiln does not read .bin/.pt checkpoints)")
    if files[0].suffix == ".gguf" and len(files) > 1:
        raise KilnError(f"{model_dir} holds {len(files)} GGUF files; pass the one to run (kiln compile FILE.gguf)")
    return files


def open_checkpoint(path: Path) -> SafetensorsFile | GgufFile:
    """The reader for one checkpoint file, by its suffix."""
    return GgufFile(path) if path.suffix == ".gguf" else SafetensorsFile(path)


def model_directory(model: str | Path, cache_dir: Path) -> Path:
    """The directory kiln reads model `model` from: a Hugging Face directory as it is, a GGUF file through
    its view in `cache_dir` (`kiln.weights.gguf_file.model_view`)."""
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        from kiln.weights.gguf_file import model_view

        return model_view(path, cache_dir)
    if path.is_file():
        raise KilnError(f"{path} is a file: kiln runs a Hugging Face model directory (config.json, safetensors, "
                        "tokenizer) or a .gguf file")
    if not path.is_dir():
        raise KilnError(f"model directory {path} does not exist")
    return path


def stored_types(model_dir: Path) -> dict[str, int] | None:
    """How many tensors of each type a GGUF checkpoint holds (e.g. {"F32": 61, "Q4_K": 120}); None for
    safetensors, whose dtypes say it."""
    files = checkpoint_files(model_dir)
    if files[0].suffix != ".gguf":
        return None
    with GgufFile(files[0]) as f:
        return dict(sorted(f.types.items()))


def stored_quantization(model_dir: Path) -> tuple[str, str] | None:
    """The kiln scheme a GGUF checkpoint's projections run in unless asked otherwise, and how they reach it: int4
    as stored where every projection is Q4_0, Q4_1 or Q4_K (`GgufFile.int4_codes`); q8_0 where at least half their
    weights are Q8_0 (`GgufFile.int8_codes`: Q8_0's and Q5_0's codes as stored, other types requantized in groups
    of 32); int4 for another mix of quantized types (the K-quant mixes; their Q5_0, Q6_K and Q8_0 tensors
    requantized in groups of 32). None where any projection is stored in floating point, and for safetensors."""
    files = checkpoint_files(model_dir)
    if files[0].suffix != ".gguf":
        return None
    from kiln.weights.gguf_file import EXACT_INT4, EXACT_INT8, FLOAT_TYPES

    weights: Counter = Counter()
    with GgufFile(files[0]) as f:
        for name in f.keys():
            if name.endswith(PROJECTION_WEIGHTS):
                weights[f.stored_type(name)] += f.numel(name)
    kinds = ", ".join(sorted(weights))
    if not weights or set(weights) & set(FLOAT_TYPES):
        return None
    if set(weights) <= set(EXACT_INT4):
        return "int4", f"kiln's int4 codes as stored ({kinds})"
    if 2 * weights["Q8_0"] >= sum(weights.values()):
        requantized = sorted(set(weights) - set(EXACT_INT8))
        return "q8_0", f"kiln's q8_0 codes as stored ({kinds}" + (
            f"; {', '.join(requantized)} requantized in groups of 32)" if requantized else ")")
    return "int4", f"{kinds}, requantized to int4 in groups of 32 where not Q4_0, Q4_1 or Q4_K"
