"""A model's weights through a load: what `LLM` calls, and all it calls of `kiln.weights`.

They are read from the checkpoint with every byte checksummed (`loader`), packed for an artifact
from the pack cache's file where the checksum finds one (`pack_cache`), and moved onto huge pages
once the model serves (`huge_pages`).
"""

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn

from kiln.weights import checkpoint, huge_pages, loader, pack_cache
from kiln.weights.pack_cache import PackFile, Slot

PackFileOpener = Callable[[list[Slot]], PackFile]
"""opener(slots) -> the pack cache file for those slots (`kiln.weights.pack_cache.PackFile`)."""


class ModelWeights:
    """The weights of the checkpoint in `model_dir`."""

    def __init__(self, model_dir: Path):
        self.model_dir = Path(model_dir)
        self.checksum: str | None = None
        """The checksum of every checkpoint byte loaded (`kiln.checksum`): what keys the packed weights."""

    @staticmethod
    def directory(model: str | Path, cache_dir: Path) -> Path:
        """The directory model `model` is read from: a Hugging Face directory as given, a GGUF file through
        its model view in `cache_dir` (`kiln.weights.gguf_file`)."""
        return checkpoint.model_directory(model, cache_dir)

    @property
    def name(self) -> str:
        """The checkpoint's name for messages: its GGUF file's, else its directory's."""
        files = checkpoint.checkpoint_files(self.model_dir)
        return files[0].name if files[0].suffix == ".gguf" else self.model_dir.name

    def stored_quantization(self) -> tuple[str, str] | None:
        """The scheme a GGUF checkpoint's quantized projections run in unless asked otherwise, and how they reach
        it (`kiln.weights.checkpoint.stored_quantization`); None for any other checkpoint."""
        return checkpoint.stored_quantization(self.model_dir)

    def stored_types(self) -> dict[str, int] | None:
        """A GGUF checkpoint's tensor count by stored type (None for safetensors): what an artifact records of
        the file it was compiled for."""
        return checkpoint.stored_types(self.model_dir)

    def bytes_in(self, dtype: torch.dtype, quantize: str | None = None) -> int:
        """The memory the checkpoint's tensors take once loaded to run in `dtype`, its projections
        quantized with the `quantize` scheme (from file headers)."""
        return loader.checkpoint_bytes(self.model_dir, dtype, quantize)

    def load_into(self, model: nn.Module) -> str:
        """Read the checkpoint into `model`'s parameters; returns (and keeps) the checksum of what was read."""
        self.checksum = loader.load_weights(model, self.model_dir)
        return self.checksum

    @staticmethod
    def pack_file(cache_dir: Path, identity: dict) -> PackFileOpener | None:
        """Where a compiled program's packed weights are kept between loads, keyed by `identity` (the
        checkpoint's checksum and whatever else shapes the packed bytes); None where `$KILN_PACK_CACHE`
        is off."""
        folder = pack_cache.folder_for(cache_dir)
        return None if folder is None else partial(PackFile, folder, identity)

    @staticmethod
    def settle() -> None:
        """Move the packed weights onto huge pages from now on, in idle time (once the model is ready)."""
        huge_pages.start()
