"""A safetensors file read tensor by tensor with positioned reads: a tensor whose dtype and layout
match its parameter is read straight into the parameter's memory, any other into one temporary
tensor, so loading holds the weights once, never the checkpoint beside them.

Why not a memory map (`safetensors.safe_open`): its pages count as the process's resident memory for
as long as the map is open, so reading every tensor through it holds the checkpoint beside the copied
weights (2x) unless each tensor's pages are dropped again; reads put the bytes straight where they go
and leave them in the page cache, which the kernel reclaims as it needs.

The format: a little-endian u64 header length, a JSON header of name -> dtype, shape and byte
offsets, then the data.
"""

import json
import math
import os
import struct
from pathlib import Path

import torch

from kiln import checksum
from kiln.errors import KilnError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


class SafetensorsFile:
    """One checkpoint file's header, and reads of its tensors; use as a context manager."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            size = os.fstat(self._fd).st_size
            (length,) = struct.unpack("<Q", os.pread(self._fd, 8, 0))
            if length > size:
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(os.pread(self._fd, length, 8))
        except (ValueError, struct.error, OSError, UnicodeDecodeError) as e:  # an empty, cut or foreign file
            self.close()
            raise KilnError(f"{self.path} is not a readable safetensors file ({e})") from None
        header.pop("__metadata__", None)
        self._start = 8 + length
        self._entries: dict = header
        self.digests: dict[str, bytes] = {}
        """The checksum (`kiln.checksum`) of each tensor or row range read, by "name[begin:end]": what
        tells this file's loaded contents from another's, at memory speed."""
        for name, entry in header.items():
            begin, end = entry["data_offsets"]
            if entry["dtype"] not in DTYPES:
                self.close()
                raise KilnError(f"tensor {name!r} in {self.path.name} has dtype {entry['dtype']}, which kiln "
                                "does not read")
            if self._start + end > size or begin > end:
                self.close()
                raise KilnError(f"{self.path} is truncated: tensor {name!r} runs past the end of the file "
                                "(an interrupted download?)")

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> list[int]:
        return list(self._entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return DTYPES[self._entries[name]["dtype"]]

    def numel(self, name: str) -> int:
        return math.prod(self._entries[name]["shape"])

    def tensor(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `name` (or only `rows` = (start, count) of its first dimension), read into a new tensor."""
        shape = self.shape(name)
        if rows is not None:
            shape[0] = rows[1]
        out = torch.empty(shape, dtype=self.dtype(name))
        self.read_into(name, out, rows)
        return out

    def read_into(self, name: str, out: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Read tensor `name` (or `rows` of it) into `out`, a contiguous CPU tensor of its dtype and
        element count, with no copy between."""
        entry = self._entries[name]
        begin, end = entry["data_offsets"]
        if rows is not None:
            row_bytes = (end - begin) // max(entry["shape"][0], 1)
            begin, end = begin + rows[0] * row_bytes, begin + (rows[0] + rows[1]) * row_bytes
        if not out.is_contiguous() or out.dtype != self.dtype(name) or out.numel() * out.element_size() != end - begin:
            raise ValueError(f"cannot read {name} into a {out.dtype} tensor of shape {list(out.shape)}")
        view, offset = memoryview(out.view(-1).view(torch.uint8).numpy()), self._start + begin
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done:done + (1 << 30)]], offset + done)
            if n == 0:
                raise KilnError(f"{self.path} ended while reading {name}: the file is truncated")
            done += n
        self.digests[f"{name}[{begin}:{end}]"] = checksum.digest(view)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
