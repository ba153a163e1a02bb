"""The compiled backbone as a callable, and the input contract that binds it to a model and a batch.

A traced graph's inputs are the model's weights, the batch tensors, the per-layer KV caches and
symbolic sizes. `GraphInput` records where each comes from, so the program can be called with the
same arguments as `CausalLM.forward` without Dynamo.
"""

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from kiln.errors import KilnError
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

    @property
    def arg_name(self) -> str:
        """A readable Python identifier for this input in the stitching code."""
        if self.kind == "weight":
            return "w_" + self.name.replace(".", "_")
        return f"kv_cache_{self.name}" if self.kind == "kv_cache" else self.name


def arg_names(inputs: list[GraphInput]) -> list[str]:
    names: list[str] = []
    for i, spec in enumerate(inputs):
        name = spec.arg_name
        names.append(f"{name}_{i}" if name in names else name)
    return names


@dataclass
class SizedPiece:
    """A compiled piece in its size variants: the static compile for the exact token count if there
    is one, else the dynamic one (None in a variant that serves static sizes only). `tokens` locates
    the token count among the arguments: (index, None) for an int argument, (index, dim) for a
    tensor's dimension."""

    dynamic: Callable | None
    tokens: tuple[int, int | None] | None = None
    static: dict[int, Callable] = field(default_factory=dict)
    returns_tuple: bool = True

    def __call__(self, *args):
        fn = self.dynamic
        if self.static and self.tokens is not None:
            i, dim = self.tokens
            fn = self.static.get(args[i] if dim is None else args[i].shape[dim], fn)
        out = fn(*args)
        if self.returns_tuple:
            return tuple(out)
        return out[0] if isinstance(out, (list, tuple)) else out


class ByTokenCount:
    """Calls the program variant that serves the batch's token count: an exact static size first,
    else the size range that holds it."""

    def __init__(self, routes: list[tuple[tuple[int, int], Callable]], tokens_at: int):
        self.routes = sorted(routes, key=lambda r: r[0][1] - r[0][0])  # narrowest first: static sizes
        self.tokens_at = tokens_at

    @property
    def max_num_tokens(self) -> int:
        """The largest batch any variant serves: the compile's max_num_tokens."""
        return max(high for (_, high), _ in self.routes)

    def __call__(self, *args):
        n = args[self.tokens_at].shape[0]
        for (low, high), forward in self.routes:
            if low <= n <= high:
                return forward(*args)
        raise KilnError(f"a batch of {n} tokens is larger than the artifact's max_num_tokens ({self.max_num_tokens}): "
                        f"lower max_num_batched_tokens or compile with a larger --max-num-tokens")


def load_program(source: str, filename: str, pieces: dict[str, Callable]) -> Callable:
    """Execute the stitching code of `kiln compile` and bind its compiled pieces."""
    namespace: dict = {"__name__": "kiln_program"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace["Program"](pieces).forward


class CompiledProgram:
    """Runs `graph` (the split backbone, its pieces compiled) on a model's weights and a batch.

    Weights are bound once here; each call binds only the batch's tensors and sizes.
    """

    def __init__(self, graph: Callable, inputs: list[GraphInput], model: nn.Module):
        self.graph, self.inputs = graph, inputs
        weights = dict(model.named_parameters()) | dict(model.named_buffers())
        self._bound = [weights[spec.name] if spec.kind == "weight" else None for spec in inputs]
        self._per_call = [(i, spec) for i, spec in enumerate(inputs) if spec.kind in ("input", "meta", "kv_cache")]
        self._sizes = [(i, spec.of, spec.dim) for i, spec in enumerate(inputs) if spec.kind == "size"]

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        batch = {"input_ids": input_ids, "positions": positions}
        args = list(self._bound)
        for i, spec in self._per_call:
            if spec.kind == "input":
                args[i] = batch[spec.name]
            elif spec.kind == "meta":
                args[i] = getattr(attn_metadata, spec.name)
            else:
                args[i] = kv_caches[int(spec.name)]
        for i, of, dim in self._sizes:  # after the tensors: a size may precede the tensor it measures
            args[i] = args[of].shape[dim]
        out = self.graph(*args)
        return out[0] if isinstance(out, (tuple, list)) else out
