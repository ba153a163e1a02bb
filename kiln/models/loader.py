"""Load Hugging Face safetensors checkpoints (single file or sharded with an index) into kiln models.

Every tensor is checked: a missing, unexpected or wrongly shaped tensor is one `KilnError` naming it.
"""

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open

from kiln.errors import KilnError
from kiln.models.llama import CausalLM

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise KilnError(f"{index} lists {', '.join(missing)}, which is not in {model_dir}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise KilnError(f"{model_dir} has no *.safetensors weights (kiln does not read .bin/.pt checkpoints)")
    return files


def _target(model: CausalLM, params: dict[str, torch.Tensor], name: str) -> tuple[str, int, int] | None:
    """Map a checkpoint name to (kiln parameter, row offset, row count); None if kiln ignores it."""
    if name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight" and model.config.tie_word_embeddings):
        return None
    for hf_proj, (merged, index) in model.stacked_params.items():
        if f".{hf_proj}." in name:
            kiln_name = name.replace(f".{hf_proj}.", f".{merged}.")
            sizes = model.stacked_sizes(merged)
            return kiln_name, sum(sizes[:index]), sizes[index]
    if name in params:
        return name, 0, params[name].shape[0]
    raise KilnError(
        f"unexpected tensor {name!r} in the checkpoint: it does not belong to a "
        f"{model.config.architecture} with this config.json (wrong config or wrong weights?)"
    )


def load_weights(model: CausalLM, model_dir: str | Path) -> None:
    """Copy every checkpoint tensor into its (possibly merged) parameter, casting to the model dtype."""
    start = time.perf_counter()
    model_dir = Path(model_dir)
    params = dict(model.named_parameters())
    expected: dict[tuple[str, int], str] = {}  # (kiln param, row offset) -> checkpoint name
    for pname, p in params.items():
        merged = next((m for m, _ in model.stacked_params.values() if f".{m}." in pname), None)
        if merged is None:
            expected[(pname, 0)] = pname
            continue
        offset = 0
        for hf_proj, (m, index) in model.stacked_params.items():
            if m == merged:
                expected[(pname, offset)] = pname.replace(f".{merged}.", f".{hf_proj}.")
                offset += model.stacked_sizes(merged)[index]
    loaded: set[tuple[str, int]] = set()
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                target = _target(model, params, name)
                if target is None:
                    continue
                pname, offset, rows = target
                param = params[pname]
                want = (rows, *param.shape[1:])
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != want:
                    raise KilnError(
                        f"tensor {name!r} in {path.name} has shape {list(tensor.shape)}, but config.json "
                        f"implies {list(want)}: the weights do not match the config"
                    )
                param.data[offset : offset + rows].copy_(tensor)
                loaded.add((pname, offset))
    missing = [hf for key, hf in expected.items() if key not in loaded]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise KilnError(f"checkpoint in {model_dir} is missing tensor {missing[0]!r}{more}")
    logger.info("loaded %d tensors from %s in %.2fs", len(loaded), model_dir, time.perf_counter() - start)
