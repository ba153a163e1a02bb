"""Load Hugging Face safetensors checkpoints (single file or sharded with an index), or a GGUF file
through its view directory (`kiln.weights.gguf_file`), into kiln models.

Every tensor is checked: a missing, unexpected or wrongly shaped tensor is one `KilnError` naming it.
Tensors are read straight into their parameters where dtype and layout allow, on a thread per core
(else one at a time through a temporary tensor): loading holds the weights once, not the checkpoint
beside them.
"""

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from kiln import checksum
from kiln.errors import KilnError
from kiln.kernels import quantize_weight
from kiln.kernels.quant import ACT_BLOCK, INT4_GROUP, quantize_weight_grouped, quantize_weight_int4
from kiln.models.llama import CausalLM
from kiln.models.moe import expert_sources
from kiln.models.quantization import SCHEMES, int4_group
from kiln.models.tensor_parallel import Shard
from kiln.weights.checkpoint import PROJECTION_WEIGHTS, checkpoint_files, open_checkpoint
from kiln.weights.gguf_file import GgufFile
from kiln.weights.safetensors_file import SafetensorsFile

logger = logging.getLogger(__name__)

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)




def checkpoint_bytes(model_dir: Path, dtype: torch.dtype, quantize: str | None = None) -> int:
    """Bytes the checkpoint's tensors take once loaded to run in `dtype` (floating-point tensors are
    cast to it; quantized weights stay as stored; with the `quantize` scheme, projections take a byte
    a weight and a scale a row, or for int4 half a byte and an fp16 scale and minimum a group, for q8_0 a byte
    and an fp16 scale a group), read from the files' headers alone."""
    total = 0
    for path in checkpoint_files(model_dir):
        with open_checkpoint(path) as f:
            for name in f.keys():
                stored = f.dtype(name)
                if quantize and stored.itemsize > 1 and name.endswith(PROJECTION_WEIGHTS):
                    rows, k = f.shape(name)
                    total += rows * k // 2 + 4 * rows * (k // int4_group(k)) if quantize == "int4" else \
                        rows * k + 2 * rows * (k // ACT_BLOCK) if quantize == "q8_0" else rows * k + 4 * rows
                    continue
                size = dtype.itemsize if stored.is_floating_point and stored.itemsize > 1 else stored.itemsize
                total += size * f.numel(name)
    return total


def _sources(model: CausalLM, pname: str, param: torch.Tensor) -> list[tuple[str, int, int]]:
    """The checkpoint tensors that make up kiln parameter `pname`: (name, row offset, rows). A merged
    projection (qkv, gate_up) stacks its Hugging Face slices along rows; its one static `input_scale`
    is shared by all of them."""
    experts = expert_sources(model.config, pname, model.layout.moe_intermediate_size)
    if experts is not None:
        return experts
    merged = next((m for m, _ in model.stacked_params.values() if f".{m}." in pname), None)
    if merged is None:
        return [(pname, 0, param.shape[0] if param.dim() else 1)]
    sources, offset = [], 0
    for hf_proj, (m, index) in model.stacked_params.items():
        if m != merged:
            continue
        rows = model.stacked_sizes(merged)[index]
        name = pname.replace(f".{merged}.", f".{hf_proj}.")
        sources.append((name, 0, 1) if pname.endswith(".input_scale") else (name, offset, rows))
        offset += rows
    return sources


def _fit(name: str, tensor: torch.Tensor, param: torch.Tensor, rows: int, path: Path) -> torch.Tensor:
    """Check one checkpoint tensor against its slice of `param`; returns it in the slice's shape."""
    if name.endswith(".weight_packed"):  # 4-bit codes eight to an int32: as bytes, two to a byte (little-endian)
        if tensor.dtype != torch.int32:
            raise KilnError(f"tensor {name!r} in {path.name} is {tensor.dtype}, but pack-quantized weights are "
                            "torch.int32: the weights do not match the config")
        tensor = tensor.contiguous().view(torch.uint8)
    quantized = param.dtype in (torch.int8, torch.float8_e4m3fn)
    if quantized and tensor.dtype != param.dtype:
        raise KilnError(f"tensor {name!r} in {path.name} is {tensor.dtype}, but config.json's "
                        f"quantization_config implies {param.dtype}: the weights do not match the config")
    grouped = name.endswith(".weight_scale") and param.dim() == 2  # int4: a scale per row and group, as stored
    if name.endswith((".weight_scale", ".input_scale")) and not grouped:
        # per-channel scales are stored [N, 1]; per-tensor ones [1] or [] and hold for every row
        tensor = tensor.reshape(-1)
        if tensor.numel() == 1:
            tensor = tensor.expand(rows)
    _check_shape(name, tensor, (rows, *param.shape[1:]), path)
    return tensor


def _check_shape(name: str, tensor: torch.Tensor, want: tuple[int, ...], path: Path) -> None:
    if tuple(tensor.shape) != want:
        raise KilnError(f"tensor {name!r} in {path.name} has shape {list(tensor.shape)}, but config.json "
                        f"implies {list(want)}: the weights do not match the config")


def _read(f: SafetensorsFile | GgufFile, name: str, shard: Shard | None, rows: int, path: Path) -> torch.Tensor:
    """Checkpoint tensor `name`, or only this rank's `shard` of it (a shard of rows is all that is read).
    Rows the parameter holds beyond the shard (vocabulary padding, a bias only rank 0 adds) are zeros."""
    if shard is None:
        return f.tensor(name)
    shape = f.shape(name)
    if len(shape) <= shard.dim or shape[shard.dim] < shard.start + shard.size:
        raise KilnError(f"tensor {name!r} in {path.name} has shape {shape}, too small for this rank's shard "
                        f"({shard.size} from {shard.start} along dim {shard.dim}): the weights do not match the config")
    if shard.dim == 0:
        tensor = f.tensor(name, rows=(shard.start, shard.size))
    else:
        index = [slice(None)] * len(shape)
        index[shard.dim] = slice(shard.start, shard.start + shard.size)
        tensor = f.tensor(name)[tuple(index)]
    if shard.dim == 0 and tensor.shape[0] < rows:
        tensor = torch.cat([tensor, tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])])
    return tensor


def _shard(model: CausalLM, name: str, param: torch.Tensor) -> Shard | None:
    """This rank's slice of checkpoint tensor `name`. A pack-quantized projection's codes and grouped
    scales take its weight's slice: the same rows, and in a row-parallel layer the same input channels,
    counted in their own columns (eight codes to an int32 word, a group's channels to a scale)."""
    packed = name.endswith(".weight_packed")
    grouped = name.endswith(".weight_scale") and param.dim() == 2
    if not (packed or grouped):
        return model.layout.shard(name)
    shard = model.layout.shard(name.removesuffix("_packed") if packed else name.removesuffix("_scale"))
    if shard is None or shard.dim == 0:
        return shard
    per_column = 8 if packed else shard.size // param.shape[1]  # whole groups a rank: `quantized_layout` checked
    return Shard(1, shard.start // per_column, shard.size // per_column)


def _load_tensor(f: SafetensorsFile | GgufFile, name: str, model: CausalLM, params: dict, targets: dict,
                 pool: ThreadPoolExecutor) -> list[Future]:
    """Copy checkpoint tensor `name` into its slice of its parameter: a read submitted to `pool` when
    it can go straight into the parameter's memory, else done here (a cast, a shard, a scale)."""
    if name not in targets:
        raise KilnError(
            f"unexpected tensor {name!r} in the checkpoint: it does not belong to a "
            f"{model.config.architecture} with this config.json (wrong config or wrong weights?)"
        )
    pname, offset, rows = targets[name]
    param = params[pname]
    shard, dest = _shard(model, name, param), param.data[offset : offset + rows]
    scale = params.get(pname.removesuffix(".weight") + ".weight_scale") if pname.endswith(".weight") else None
    scheme = getattr(model, "quantize_on_load", None)
    if scheme is not None and scale is not None and f.dtype(name) != param.dtype:
        low = params.get(pname.removesuffix(".weight") + ".weight_min")
        exact = None  # a GGUF tensor whose codes the scheme holds as stored: Q4_0/Q4_1/Q4_K, Q8_0/Q5_0
        if shard is None and isinstance(f, GgufFile):
            if scheme == "int4" and scale.shape[1] * INT4_GROUP == f.shape(name)[1]:
                exact = f.int4_codes(name)
            elif scheme == "q8_0":
                exact = f.int8_codes(name)
        if exact is not None:
            for dest, value in zip((param, scale, low), exact):  # (codes, scales[, minimums])
                _check_shape(name, value, (rows, *dest.shape[1:]), f.path)
                dest.data[offset:offset + rows].copy_(value)
            return []
        _quantize_into(_read(f, name, shard, rows, f.path), scheme, model, param, scale, low, offset, rows, name,
                       f.path)
        return []
    if (shard is None and f.dtype(name) == param.dtype and dest.device.type == "cpu"
            and dest.is_contiguous() and f.shape(name) == list(dest.shape) and param.dim() > 1):
        return [pool.submit(f.read_into, name, dest)]  # the common case: no copy at all
    tensor = _fit(name, _read(f, name, shard, rows, f.path), param, rows, f.path)
    if name.endswith(".input_scale"):
        torch.maximum(param.data, tensor.to(param.device, param.dtype), out=param.data)
    else:
        dest.copy_(tensor)
    return []


def _quantize_into(tensor: torch.Tensor, scheme: str, model: CausalLM, weight: torch.Tensor, scale: torch.Tensor,
                   low: torch.Tensor | None, offset: int, rows: int, name: str, path: Path) -> None:
    """Quantize one full-precision checkpoint slice into its rows of a projection's codes and scales (and
    int4's minimums, `low`), as `quantize_model` would the whole loaded projection (per row, from the model
    dtype's values)."""
    _check_shape(name, tensor, (rows, weight.shape[1] * (2 if scheme == "int4" else 1)), path)
    tensor = tensor.to(model.model.embed_tokens.weight.dtype)
    if scheme == "int4":
        codes, scales, mins = quantize_weight_int4(tensor, tensor.shape[1] // scale.shape[1])
        low.data[offset:offset + rows].copy_(mins)
    elif scheme == "q8_0":
        codes, scales = quantize_weight_grouped(tensor, tensor.shape[1] // scale.shape[1])
    else:
        codes, scales = quantize_weight(tensor, weight.dtype, SCHEMES[scheme].weight_max)
    weight.data[offset:offset + rows].copy_(codes)
    scale.data[offset:offset + rows].copy_(scales)


def _packs_int4(model: CausalLM) -> bool:
    quantization = model.config.quantization
    return quantization is not None and quantization.scheme == "int4"


def _check_weight_shape(f: SafetensorsFile, name: str, model: CausalLM, targets: dict) -> None:
    """A pack-quantized projection's `weight_shape` ([N, K] of its codes, whole) against config.json's."""
    if name.removesuffix("_shape") + "_packed" not in targets:
        raise KilnError(f"unexpected tensor {name!r} in {f.path.name}: no packed weight of this model has that name")
    want = list(model.config.projection_shape(name.split(".")[-2]))
    if f.tensor(name).tolist() != want:
        raise KilnError(f"tensor {name!r} in {f.path.name} says the weight is {f.tensor(name).tolist()}, but "
                        f"config.json implies {want}: the weights do not match the config")


def load_weights(model: CausalLM, model_dir: str | Path) -> str:
    """Copy every checkpoint tensor into its (possibly merged) parameter, casting to the model dtype;
    under tensor parallelism only this rank's shard of each is read. Returns the checksum of every
    byte read (`kiln.checksum`, hex): the identity of what was loaded, by content."""
    start = time.perf_counter()
    model_dir = Path(model_dir)
    params = dict(model.named_parameters())
    targets = {name: (pname, offset, rows)
               for pname, p in params.items() for name, offset, rows in _sources(model, pname, p)}
    # int4's minimums are never in a file: quantizing gives them, or a symmetric checkpoint's scales (below)
    targets = {name: target for name, target in targets.items() if not target[0].endswith(".weight_min")}
    if getattr(model, "quantize_on_load", None) is not None:  # the scales come from quantizing, not the file
        targets = {name: target for name, target in targets.items() if not target[0].endswith(".weight_scale")}
    if _packs_int4(model):  # a pack-quantized checkpoint names the codes weight_packed
        targets = {name + "_packed" if name.endswith(".weight") and params[target[0]].dtype == torch.uint8 else name:
                   target for name, target in targets.items()}
    for pname, p in params.items():
        if pname.endswith(".input_scale"):
            p.data.zero_()  # a static input scale is the max over the slices that share it
    loaded: set[str] = set()
    content = checksum.hasher()
    # reads run on a thread per core: filling fresh memory costs more in page faults than in the copy
    # (a VM's faults especially), and threads take their faults in parallel
    with ThreadPoolExecutor(torch.get_num_threads()) as pool:
        for path in checkpoint_files(model_dir):
            with open_checkpoint(path) as f:
                reads = []
                try:
                    for name in f.keys():
                        if name.endswith(".weight_shape") and _packs_int4(model):
                            _check_weight_shape(f, name, model, targets)
                        elif not (name.endswith(IGNORED_SUFFIXES) or (name == "lm_head.weight"
                                                                      and model.config.tie_word_embeddings)):
                            loaded.add(name)
                            reads += _load_tensor(f, name, model, params, targets, pool)
                finally:
                    wait(reads)  # before the file closes, also when a tensor fails
                for read in reads:
                    read.result()
                for key, digest in sorted(f.digests.items()):
                    content.update(f"{path.name}:{key}:".encode() + digest)
                if isinstance(f, GgufFile):
                    logger.info("%s: tensors %s", path.name, f.summary())
    missing = [name for name in targets if name not in loaded]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise KilnError(f"checkpoint in {model_dir} is missing tensor {missing[0]!r}{more}")
    if _packs_int4(model):  # symmetric codes c stored as c + 8: the minimum is -8 x scale
        for pname, p in params.items():
            if pname.endswith(".weight_min"):
                p.data.copy_(params[pname.removesuffix("_min") + "_scale"].data * -8)
    logger.info("loaded %d tensors from %s in %.2fs", len(loaded), model_dir, time.perf_counter() - start)
    return content.hexdigest()
