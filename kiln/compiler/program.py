"""The compiled backbone as a callable, and the input contract that binds it to a model and a batch.

A traced graph's inputs are the model's weights, the batch tensors, the per-layer KV caches and
symbolic sizes. `GraphInput` records where each comes from, so the program can be called with the
same arguments as `CausalLM.forward` without Dynamo.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kiln.kernels import AttentionMetadata


@dataclass(frozen=True)
class GraphInput:
    """One graph input. kind: "weight" (a parameter or buffer, by name), "input" (`input_ids` or
    `positions`), "meta" (an AttentionMetadata field), "kv_cache" (layer index in `name`), or "size"
    (dimension `dim` of the graph input at index `of`)."""

    kind: str
    name: str
    of: int | None = None
    dim: int | None = None


class CompiledProgram:
    """Runs `graph` (the split backbone, its pieces compiled) on a model's weights and a batch."""

    def __init__(self, graph: Callable, inputs: list[GraphInput], model: nn.Module):
        self.graph, self.inputs = graph, inputs
        self.weights = dict(model.named_parameters()) | dict(model.named_buffers())

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        batch = {"input_ids": input_ids, "positions": positions}
        args: list = []
        for spec in self.inputs:
            if spec.kind == "weight":
                args.append(self.weights[spec.name])
            elif spec.kind == "input":
                args.append(batch[spec.name])
            elif spec.kind == "meta":
                args.append(getattr(attn_metadata, spec.name))
            elif spec.kind == "kv_cache":
                args.append(kv_caches[int(spec.name)])
            else:
                args.append(None)
        for i, spec in enumerate(self.inputs):  # sizes may precede the tensor they measure
            if spec.kind == "size":
                args[i] = args[spec.of].shape[spec.dim]
        out = self.graph(*args)
        return out[0] if isinstance(out, (tuple, list)) else out
