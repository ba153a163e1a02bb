"""`kiln::all_reduce` (the tensor-parallel sum over ranks) and `kiln::all_gather`, as functional graph
ops, so passes see them whole (the allreduce+RMSNorm fusion matches all_reduce) and Dynamo traces
them like any other kiln op."""

import torch
import torch.distributed as dist

from kiln.kernels.norm import fused_add_rms_norm_native
from kiln.kernels.quant import quant_fake, quant_native


def _group(group_name: str):
    """The process group named `group_name` ("": the default group)."""
    if not group_name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


@torch.library.custom_op("kiln::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """Sum `x` over the ranks of the group named `group_name`; a copy of `x` when there is no group
    (one process: tensor parallel size 1)."""
    out = x.clone()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(out, group=_group(group_name))
    return out


@all_reduce.register_fake
def _(x: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("kiln::all_gather", mutates_args=())
def all_gather(x: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    """Every rank's `x`, stacked in rank order: [world_size, *x.shape]. `world_size` is an argument
    so the output's shape is known while tracing, where there is no process group."""
    out = x.new_empty((world_size, *x.shape))
    if dist.is_available() and dist.is_initialized():
        dist.all_gather(list(out.unbind(0)), x.contiguous(), group=_group(group_name))
    elif world_size == 1:
        out[0] = x
    else:
        raise RuntimeError(f"kiln::all_gather over {world_size} ranks needs an initialized process group")
    return out


@all_gather.register_fake
def _(x: torch.Tensor, world_size: int, group_name: str) -> torch.Tensor:
    return x.new_empty((world_size, *x.shape))


@torch.library.custom_op("kiln::all_reduce_fused_add_rms_norm", mutates_args=())
def all_reduce_fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, world_size: int, group_name: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_add_rms_norm(all_reduce(x), residual, weight, eps)` as one op. The ranks' partial
    sums are gathered and summed in the same pass that adds the residual and normalizes."""
    return fused_add_rms_norm_native(all_gather(x, world_size, group_name).sum(0), residual, weight, eps)


@all_reduce_fused_add_rms_norm.register_fake
def _(x, residual, weight, eps, world_size, group_name):
    return torch.empty_like(x), torch.empty_like(x)


@torch.library.custom_op("kiln::all_reduce_fused_add_rms_norm_quant", mutates_args=())
def all_reduce_fused_add_rms_norm_quant(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, quant_dtype: torch.dtype,
    scale: torch.Tensor | None, world_size: int, group_name: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`fused_add_rms_norm_quant(all_reduce(x), ...)` as one op -> (q, scale, residual)."""
    normed, new_residual = fused_add_rms_norm_native(all_gather(x, world_size, group_name).sum(0), residual,
                                                     weight, eps)
    return (*quant_native(normed, scale, quant_dtype), new_residual)


@all_reduce_fused_add_rms_norm_quant.register_fake
def _(x, residual, weight, eps, quant_dtype, scale, world_size, group_name):
    return (*quant_fake(x, scale, quant_dtype), torch.empty_like(x))
