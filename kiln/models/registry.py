"""Which kiln model class implements each Hugging Face `architectures` entry, and how to build one."""

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from kiln.config import ParallelConfig
from kiln.errors import KilnError
from kiln.models.config import ARCHITECTURES, ModelConfig
from kiln.models.llama import CausalLM
from kiln.models.quantization import quantized_layout

MODEL_CLASSES: dict[str, type[CausalLM]] = {arch: CausalLM for arch in ARCHITECTURES}


@contextlib.contextmanager
def _skip_random_init() -> Iterator[None]:
    """The loader overwrites every weight, so torch's random init is wasted work; on meta tensors it
    also routes through torch._refs, whose first call imports Dynamo (~1.5 s of an eager start)."""
    saved = [(cls, cls.reset_parameters) for cls in (nn.Linear, nn.Embedding)]
    for cls, _ in saved:
        cls.reset_parameters = lambda self: None
    try:
        yield
    finally:
        for cls, reset in saved:
            cls.reset_parameters = reset


def create_model(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu",
                 parallel: ParallelConfig = ParallelConfig(), quantize: str | None = None) -> CausalLM:
    """Build a model (this rank's share of it) with uninitialized weights (no random init: the loader
    overwrites them), with quantized projections when the checkpoint is quantized, or when `quantize`
    names a scheme for a full-precision one: the loader then quantizes each projection as it reads it
    (`quantize_on_load`), so the full-precision projections are never all in memory."""
    if cfg.moe is not None and cfg.quantization is not None:
        raise KilnError(f"pre-quantized {cfg.architecture} checkpoints are not supported yet: use its full-precision "
                        "checkpoint, with --quantization to quantize it while loading")
    with torch.device("meta"), _skip_random_init():
        model = MODEL_CLASSES[cfg.architecture](cfg, dtype, parallel)
        if cfg.quantization is not None:
            quantized_layout(model, cfg.quantization.scheme, cfg.quantization.static_input, cfg.quantization.group_size)
        elif quantize is not None:
            quantized_layout(model, quantize, static_input=False)
            model.quantize_on_load = quantize
    # not `to_empty`: its `empty_like` of a meta tensor imports sympy through torch._refs (~0.5 s of a start)
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    model.init_buffers()
    return model.eval().requires_grad_(False)
