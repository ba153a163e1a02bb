"""An artifact bound to a model: its libraries loaded, its weights packed, its program ready to run.

No tracing and no compiling: this reads what `kiln compile` wrote (`kiln.compiler.artifact` checks
it first) and imports none of Inductor.
"""

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from torch import nn

from kiln.compiler import usage
from kiln.compiler.aoti import LoadedLibrary
from kiln.compiler.artifact import (BLOCKED_HEAD_TENSOR_ARGS, HEAD_TENSOR_ARGS, MANIFEST, PROGRAMS, RECOMPILE,
                                    ArtifactError, blob_path, install_triton_kernels, lm_head_libraries, verify)
from kiln.compiler.contract import GraphInput, weight_indices
from kiln.compiler.counters import counters
from kiln.config import dtype_name
from kiln.errors import KilnError
from kiln.kernels import decode_attention, gemms, greedy_screen
from kiln.runtime.program import ByTokenCount, CompiledProgram, PackedWeights, SizedPiece, load_program
from kiln.weights.pack_cache import PackFile, Slot
from kiln.weights.packing import RELEASED, pack_lm_head, pack_slots, pack_weights

logger = logging.getLogger(__name__)


def _load_library(library: Path, tensor_args: tuple[int, ...], device: str) -> LoadedLibrary:
    try:
        return LoadedLibrary(library, tensor_args, device)
    except KilnError:
        raise
    except Exception as e:  # a library that passed its checksum but will not load (another libtorch)
        raise ArtifactError(f"artifact blob {library} does not load ({type(e).__name__}: {e}): {RECOMPILE}") from e


def load(path: Path, model: nn.Module, release_weights: bool = False,
         packs: Callable[[list[Slot]], PackFile] | None = None, factors: dict | None = None) -> CompiledProgram:
    """Load the artifact at `path` and bind it to `model`'s weights; no tracing, no compiling.

    `release_weights`: free the plain copy of each weight the program only reads packed
    (`pack_weights`): the model then serves only this program, and cannot be traced or run eagerly.
    `packs`: the cache file of packed weights for these slots (`kiln.weights.pack_cache`), where
    they are read from, or written to, instead of packed at every load. `factors`: the key factors the
    caller computed for `model` (`key.model_factors`); an artifact built for others is refused, naming
    the first that differs."""
    start = time.perf_counter()
    path = Path(path)
    lease = usage.acquire(path)  # before verifying: a pruner waits for no one it cannot see
    manifest = verify(path, factors)
    try:
        program = _bind(path, manifest, model, release_weights, packs)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        if isinstance(e, KilnError):
            raise
        raise ArtifactError(f"artifact manifest {path / MANIFEST} is damaged ({type(e).__name__}: {e}): "
                            f"{RECOMPILE}") from e
    program.lease = lease  # held while the program lives: `kiln cache prune` leaves this key alone
    logger.info("loaded artifact %s in %.2fs", path.name, time.perf_counter() - start)
    return program


def _check_kv_cache_dtype(path: Path, manifest: dict, model: nn.Module) -> None:
    """Refuse an artifact whose compiled cache write stores another dtype than the engine will allocate."""
    built = manifest["factors"].get("kv_cache_dtype", "auto")
    wanted = getattr(model, "kv_cache_dtype", None)
    wanted = "auto" if wanted is None else dtype_name(wanted)
    if built != wanted:
        raise KilnError(f"artifact {path.name} was compiled for a KV cache of {built}, and this model asks for "
                        f"{wanted}: give --kv-cache-dtype {built}, or compile for {wanted}")


def _bind(path: Path, manifest: dict, model: nn.Module, release_weights: bool,
          packs: Callable[[list[Slot]], PackFile] | None) -> CompiledProgram:
    """The verified artifact's program, bound to `model`'s weights (packed where it packs them)."""
    device = manifest["factors"]["system"]["device"]
    if device == "cuda":
        install_triton_kernels(path, manifest)
    blobs: dict[tuple[str, tuple[int, ...]], LoadedLibrary] = {}

    def library(entry: dict, args: tuple[int, ...]) -> LoadedLibrary:
        if (entry["sha256"], args) not in blobs:
            blobs[entry["sha256"], args] = _load_library(blob_path(path, entry), args, device)
            counters["blobs_loaded"] += 1
        return blobs[entry["sha256"], args]

    inputs = [GraphInput(e["kind"], e["name"], e.get("of"), e.get("dim")) for e in manifest["inputs"]]
    _check_weights(manifest["inputs"], model)
    _check_kv_cache_dtype(path, manifest, model)
    decode = manifest.get("libraries", {}).get(decode_attention.LIBRARY)
    decode_kernel = library(decode, decode_attention.LIBRARY_ARGS) if decode is not None else None
    forwards = []
    for i, variant in enumerate(manifest["variants"]):
        pieces = {}
        for name, entry in variant["pieces"].items():
            sizes, args = entry["sizes"], tuple(entry["tensor_args"])
            pieces[name] = SizedPiece(
                dynamic=library(sizes["dynamic"], args) if "dynamic" in sizes else None,
                tokens=tuple(entry["tokens"]) if entry["tokens"] is not None else None,
                static={int(s): library(e, args) for s, e in sizes.items() if s != "dynamic"},
                returns_tuple=entry["returns_tuple"],
                token_args=tuple(entry.get("token_args", ())),
            )
        program = path / PROGRAMS / f"{i}.py"
        forwards.append(load_program(program.read_text(), str(program), pieces, decode_kernel))
    head_gemms = {format: library(entry, BLOCKED_HEAD_TENSOR_ARGS if format == gemms.PANELS8_INT8_BLOCK.id
                                  else HEAD_TENSOR_ARGS) for format, entry in lm_head_libraries(manifest).items()}
    screen = manifest.get("libraries", {}).get(greedy_screen.LIBRARY)
    screen_kernel = library(screen, greedy_screen.LIBRARY_ARGS) if screen is not None else None
    # packing last: everything that can fail has loaded, so no weight is released for a failed load
    formats = [v.get("weight_formats", {}) for v in manifest["variants"]]
    pack_file = packs(pack_slots(model, formats, manifest.get("lm_head"), head_gemms)) if packs is not None else None
    with ThreadPoolExecutor(1) as pool:  # the LM head packs beside the projections
        head = pool.submit(pack_lm_head, model, manifest.get("lm_head"), head_gemms, screen_kernel, pack_file)
        packed = pack_weights(weight_indices(inputs), model, formats, release=release_weights, packs=pack_file)
        head.result()
    if pack_file is not None:
        pack_file.publish()
    routes = []
    for variant, forward, weights in zip(manifest["variants"], forwards, packed):
        if weights:
            forward = PackedWeights(forward, weights)
        routes += [((s, s), forward) for s in variant["sizes"]] + [(tuple(r), forward) for r in variant["ranges"]]
    tokens_at = next(i for i, e in enumerate(manifest["inputs"]) if e["kind"] == "input" and e["name"] == "input_ids")
    logger.info("artifact %s: %d blobs loaded", path.name, len(blobs))
    program = CompiledProgram(ByTokenCount(routes, tokens_at), inputs, model, head.result())
    program.pack_file = pack_file
    return program


def _check_weights(contract: list[dict], model: nn.Module) -> None:
    weights = dict(model.named_parameters()) | dict(model.named_buffers())
    for entry in contract:
        if entry["kind"] != "weight":
            continue
        w = weights.get(entry["name"])
        if entry["name"] in getattr(model, RELEASED, {}):
            raise KilnError(f"weight {entry['name']} of this model was released once packed for another artifact: "
                            "load the model again to bind it to this one")
        if w is None or list(w.shape) != entry["shape"] or dtype_name(w.dtype) != entry["dtype"]:
            found = "absent" if w is None else f"{list(w.shape)} {w.dtype}"
            raise ArtifactError(f"artifact expects weight {entry['name']} {entry['shape']} {entry['dtype']}, the "
                                f"model has {found}: the artifact was built for another model; {RECOMPILE}")

