"""`kiln::all_reduce`: the tensor-parallel sum over ranks, as a functional graph op, so passes see it
whole (the allreduce+RMSNorm fusion matches it) and Dynamo traces it like any other kiln op."""

import torch
import torch.distributed as dist


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
