"""kiln: a compiler-driven LLM inference runtime built on torch.compile and AOT artifacts."""

import logging

from kiln.errors import KilnError
from kiln.llm import LLM
from kiln.runtime.engine import RequestOutput
from kiln.runtime.sampler import SamplingParams

logging.getLogger("kiln").addHandler(logging.NullHandler())

__all__ = ["LLM", "KilnError", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
