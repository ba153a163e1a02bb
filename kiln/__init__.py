"""kiln: a compiler-driven LLM inference runtime built on torch.compile and AOT artifacts."""

import importlib
import logging
from typing import TYPE_CHECKING

from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.llm import LLM
    from kiln.runtime.engine import RequestOutput
    from kiln.runtime.sampler import SamplingParams

logging.getLogger("kiln").addHandler(logging.NullHandler())

__all__ = ["LLM", "KilnError", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"

_LAZY = {"LLM": "kiln.llm", "RequestOutput": "kiln.runtime.engine", "SamplingParams": "kiln.runtime.sampler"}
"""Imported on first use, so that `import kiln` (and `kiln --help`) does not import torch."""


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
