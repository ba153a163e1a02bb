"""Graph passes: kiln's fusions and cleanups, and the public API for writing your own.

    from kiln.passes import GraphPass, PatternPass, Pattern

A pass gets the traced backbone (aten-level FX, kiln ops whole) before it is split; see
docs/passes.md for a worked example.
"""

from kiln.config import PassConfig
from kiln.passes.base import GraphPass, Pattern, PatternPass, SizeRange, count_ops
from kiln.passes.manager import PassManager, PassReport, load_pass

__all__ = [
    "GraphPass",
    "PassConfig",
    "PassManager",
    "PassReport",
    "Pattern",
    "PatternPass",
    "SizeRange",
    "count_ops",
    "load_pass",
]
