"""A weight packed into its kernel's format (`kiln.kernels.gemms`), where it is served from.

A format whose packed weight is a plain tensor is written into memory on a 2 MB boundary and queued
for huge pages (`kiln.weights.huge_pages`): a decode step streams every packed weight from memory,
and on 4 KB pages each one costs a TLB miss every 4 KB.
"""

import torch

from kiln.kernels import gemms
from kiln.weights import huge_pages


def pack(format: str, weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] as loaded, packed in `format` for its kernel; a plain-tensor format on memory
    queued for huge pages."""
    if format not in gemms.PLAIN_FORMATS:
        return gemms.pack(format, weight)
    out = huge_pages.empty(tuple(weight.shape), weight.dtype)
    gemms.pack(format, weight, out=out)
    huge_pages.collapse_later(out)
    return out
