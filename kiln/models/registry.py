"""Which kiln model class implements each Hugging Face `architectures` entry, and how to build one."""

import torch

from kiln.models.config import ARCHITECTURES, ModelConfig
from kiln.models.llama import CausalLM

MODEL_CLASSES: dict[str, type[CausalLM]] = {arch: CausalLM for arch in ARCHITECTURES}


def create_model(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device = "cpu") -> CausalLM:
    """Build a model with uninitialized weights (no random init: the loader overwrites them)."""
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.architecture](cfg, dtype)
    model.to_empty(device=device)
    model.init_buffers()
    return model.eval().requires_grad_(False)
