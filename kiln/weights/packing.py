"""Weights packed for the kernels an artifact chose, and the plain copies released once packed.

The artifact records which weight takes which format (`kiln.kernels.gemms`); binding it to a model
packs them here, from the pack cache's file where one matches (`kiln.weights.pack_cache`), and the
LM head as the manifest chose it.
"""

import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from kiln.errors import KilnError
from kiln.kernels import gemms
from kiln.models.lm_head import Int8Head, PackedHead
from kiln.weights import pack_cache
from kiln.weights.formats import pack as pack_format
from kiln.weights.pack_cache import PackFile, Slot

logger = logging.getLogger(__name__)


def pack_weights(index: dict[str, int], model: nn.Module, formats: list[dict[str, str]],
                 release: bool = False, packs: PackFile | None = None) -> list[dict[int, torch.Tensor]]:
    """For each variant's {weight name: format}: {argument index: the packed weight}, `index` giving
    each weight's argument index. A weight two variants read in one format is packed once, into
    `packs`' file where given (`pack_slots`).

    `release`: a weight every variant reads packed, in one format, gives up its plain copy as soon as
    it is packed (`release_weight`), so the model holds each weight once, not twice, even while
    packing."""
    weights = dict(model.named_parameters())
    wanted = sorted({(name, fmt) for f in formats for name, fmt in f.items()})
    releasable = {name for name, fmt in wanted if release and all(f.get(name) == fmt for f in formats)}
    start = time.perf_counter()
    packed = {}
    # a weight per thread: oneDNN's reorder of one weight barely uses a second core
    with ThreadPoolExecutor(torch.get_num_threads()) as pool:
        pack = packs.pack if packs is not None else lambda name, fmt, w: pack_format(fmt, w)
        for (name, fmt), weight in zip(wanted, pool.map(lambda w: pack(w[0], w[1], weights[w[0]]), wanted)):
            packed[name, fmt] = weight
            if name in releasable:
                release_weight(model, name)
    if wanted:
        logger.info("packed %d weights for their kernels in %.2fs (%d plain copies released)", len(wanted),
                    time.perf_counter() - start, len(releasable))
    return [{index[name]: packed[name, fmt] for name, fmt in f.items()} for f in formats]


RELEASED = "released_weights"
"""The model attribute naming each released weight's shape ({name: torch.Size})."""


def release_weight(model: nn.Module, name: str) -> None:
    """Free parameter `name`'s memory, leaving an empty tensor of its dtype: a compiled program reads
    only its packed copy. The model records the shape it had (`RELEASED`) and refuses to run eagerly."""
    param = model.get_parameter(name)
    released = model.__dict__.setdefault(RELEASED, {})
    if not released:
        model.register_forward_pre_hook(_refuse_eager_run)
    released[name] = param.shape
    param.data = param.data.new_empty(0)


def _refuse_eager_run(model: nn.Module, args) -> None:
    raise KilnError(f"this model's plain projection weights were released once packed for its compiled artifact "
                    f"({len(getattr(model, RELEASED))} of them): run it through the LLM, or load it with "
                    "compile=False to call the model itself")


HEAD = "lm_head"
"""The LM head's name among packed weights (a tied head's weight is the embedding's)."""
PANELS_INT8 = gemms.PANELS16_INT8.id
PANELS8_INT8_BLOCK = gemms.PANELS8_INT8_BLOCK.id
"""The int8 panel GEMM an artifact may ship for an int8 head, which then runs on it."""


def pack_slots(model: nn.Module, formats: list[dict[str, str]], head_choice: dict | None,
               libraries: dict[str, Callable]) -> list[Slot]:
    """What `pack_weights` and `pack_lm_head` will pack into a cache file (`kiln.weights.pack_cache`):
    the projections' plain-tensor formats, and the LM head's where it runs on a panel GEMM."""
    weights = dict(model.named_parameters())
    slots = [pack_cache.slot(name, fmt, weights[name]) for f in formats for name, fmt in f.items()]
    int8_head = getattr(model, "lm_head_kernel", None)
    if isinstance(int8_head, Int8Head):
        if PANELS8_INT8_BLOCK in libraries and int8_head.blocks and not int8_head.packed:
            slots.append(pack_cache.slot(HEAD, PANELS8_INT8_BLOCK, int8_head.codes))
        elif PANELS_INT8 in libraries and not int8_head.packed:
            slots.append(pack_cache.slot(HEAD, PANELS_INT8, int8_head.codes))
    elif int8_head is None and head_choice is not None and head_choice.get("format") is not None:
        slots.append(pack_cache.slot(HEAD, head_choice["format"], model.lm_head_weight()))
    return [s for s in slots if s is not None]


def pack_lm_head(model: nn.Module, choice: dict | None, libraries: dict[str, Callable] | None = None,
                 screen: Callable | None = None, packs: PackFile | None = None) -> PackedHead | None:
    """The model's LM head as an artifact's manifest chose it (its "lm_head" entry: a packed format,
    the greedy screen's kernel), on the panel GEMM `libraries` (format -> the loaded library) it
    ships, its greedy screen on the `screen` library where it ships one; None for no format, or when
    the model has an int8 head of its own (which then runs on the int8 panel GEMM where the artifact
    ships it, and takes its greedy tokens from `screen`)."""
    libraries = libraries or {}
    packer = functools.partial(packs.pack, HEAD) if packs is not None else None
    int8_head = getattr(model, "lm_head_kernel", None)
    if isinstance(int8_head, Int8Head):
        panels, blocked = libraries.get(PANELS_INT8), libraries.get(PANELS8_INT8_BLOCK)
        if blocked is not None and int8_head.run_on_blocked_panels(
                lambda a, a_scale, weight: blocked(a.contiguous(), a_scale, weight)[0], packer):
            logger.info("the int8 LM head runs on the artifact's blocked int8 panel GEMM (activations per 32)")
        elif panels is not None and int8_head.run_on_panels(_head_gemm(panels), packer, screen):
            logger.info("the int8 LM head runs on the artifact's int8 panel GEMM%s",
                        ", its greedy tokens in one kernel" if screen is not None else "")
        int8_head.pack()
    if choice is None or choice.get("format") is None or int8_head is not None:
        return None
    start = time.perf_counter()
    head = PackedHead(model.lm_head_weight(), choice["format"], gemm=_head_gemm(libraries.get(choice["format"])),
                      screen_gemm=_head_gemm(libraries.get(choice.get("screen"))),
                      screen_library=screen if choice.get("screen") == PANELS_INT8 else None, packer=packer)
    logger.info("packed the LM head in %.2fs", time.perf_counter() - start)
    return head


def _head_gemm(library: Callable | None) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """A loaded head library as `gemm(x, packed weight)` (`kiln.models.lm_head.HeadGemm`)."""
    if library is None:
        return None
    return lambda x, weight: library(x.contiguous(), weight)[0]
