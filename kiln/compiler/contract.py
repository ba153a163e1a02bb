"""The input contract that binds a traced graph to a model and a batch.

A traced graph's inputs are the model's weights, the batch tensors, the per-layer KV caches and
symbolic sizes. `GraphInput` records where each comes from: the trace writes it into the artifact,
and the runtime calls the program with the same arguments as `CausalLM.forward`, without Dynamo.
"""

from dataclasses import dataclass


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


def weight_indices(inputs: list[GraphInput]) -> dict[str, int]:
    """Each weight input's argument index, by weight name."""
    return {spec.name: i for i, spec in enumerate(inputs) if spec.kind == "weight"}
