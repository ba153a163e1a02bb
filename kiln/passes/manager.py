"""The pass pipeline: kiln's passes in a fixed order (docs/passes.md), plus the user's.

Order: no-op elimination, RMSNorm+quant, allreduce+RMSNorm(+quant), SiLU*Mul+quant, RoPE+KV write,
attention+quant, user passes, lowering, dead code. Each pass's match count and time are reported; every pass's uuid (and which passes run) is part of the artifact key.
"""

import importlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from torch import fx

from kiln.config import PassConfig
from kiln.errors import KilnError
from kiln.passes.base import GraphPass, SizeRange
from kiln.passes.cleanup.dead_code import DeadCodeElimination
from kiln.passes.cleanup.noop_elimination import NoOpElimination
from kiln.passes.fusion.act_quant import SiluMulQuantFusion
from kiln.passes.fusion.allreduce_rms import AllReduceRMSFusion
from kiln.passes.fusion.attn_quant import AttentionQuantFusion
from kiln.passes.fusion.rms_quant import RMSNormQuantFusion
from kiln.passes.fusion.rope_kvcache import RopeKVCacheFusion
from kiln.passes.gemm_choice import GemmChoice, GemmChooser
from kiln.passes.kernel_choice import KernelChoice
from kiln.passes.lowering import Lowering

logger = logging.getLogger(__name__)

UNKNOWN = "?"
"""The match count of a pass that did not say (vLLM's passes return None)."""


@dataclass
class PassReport:
    """What one run of the pipeline did: matches and seconds per pass, in pipeline order."""

    matches: dict[str, int | str] = field(default_factory=dict)
    """Sites each pass changed; `UNKNOWN` for a user pass whose `__call__` returned None."""
    seconds: dict[str, float] = field(default_factory=dict)
    kernel_choices: list[KernelChoice] = field(default_factory=list)
    """The lowering pass's measured kernel decisions (CUDA only)."""
    gemm_choices: list[GemmChoice] = field(default_factory=list)
    """The lowering pass's measured projection kernels (CPU only)."""
    weight_formats: dict[str, str] = field(default_factory=dict)
    """Weight inputs (placeholder targets) the runtime packs, and their formats."""


def load_pass(spec: str) -> GraphPass:
    """`package.module:Name` -> an instance of that GraphPass class (or the GraphPass object itself)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise KilnError(f"--pass {spec!r}: expected module:Name, e.g. mypkg.passes:MyPass")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise KilnError(f"--pass {spec!r}: cannot import {module_name} ({e})") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise KilnError(f"--pass {spec!r}: {module_name} has no {attr!r}")
    if isinstance(obj, type) and issubclass(obj, GraphPass):
        obj = obj()
    if not isinstance(obj, GraphPass):
        raise KilnError(f"--pass {spec!r}: {attr} is not a kiln.passes.GraphPass (subclass or instance)")
    return obj


class PassManager:
    """Runs the configured pipeline on a traced graph, in order, and names it for the cache key.
    `quantization` is the model's scheme, which tells the CPU GEMM choice what its int8 weights hold."""

    def __init__(self, config: PassConfig | None = None, custom: Sequence[GraphPass] = (),
                 tensor_parallel_size: int = 1, quantization: str | None = None):
        config = config or PassConfig()
        builtin: list[tuple[bool, GraphPass]] = [
            (config.noop_elimination, NoOpElimination()),
            (config.rms_quant, RMSNormQuantFusion()),
            (config.allreduce_rms, AllReduceRMSFusion(tensor_parallel_size, config.allreduce_rms_max_tokens)),
            (config.act_quant, SiluMulQuantFusion()),
            (config.rope_kvcache, RopeKVCacheFusion()),
            (config.attn_quant, AttentionQuantFusion()),
        ]
        self.custom: list[GraphPass] = list(custom)
        self.passes: list[GraphPass] = [p for on, p in builtin if on] + self.custom
        self.gemms: GemmChooser | None = None
        if config.lowering:
            self.gemms = GemmChooser(quantization=quantization) if config.gemm_choice else None
            self.passes.append(Lowering(choose=config.kernel_choice, gemms=self.gemms))
        self.passes.append(DeadCodeElimination())
        names = [p.name for p in self.passes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise KilnError(f"two passes are named {dupes[0]!r}: give each pass its own `name`")

    def uuids(self) -> dict[str, str]:
        """Pass name -> uuid, in pipeline order: the `passes` factor of the artifact key."""
        return {p.name: p.uuid() for p in self.passes}

    def applicable(self, size_range: SizeRange) -> tuple[str, ...]:
        """Names of the passes that run for graphs serving `size_range`."""
        return tuple(p.name for p in self.passes if p.applies_to(size_range))

    def group(self, size_ranges: Sequence[SizeRange], graph: fx.Graph | None = None) -> list[list[SizeRange]]:
        """`size_ranges` grouped by the passes that apply to them and, given the traced `graph`, by the
        kernels the CPU GEMM choice gives its projections there, in first-seen order: each group needs
        one graph (kiln's passes apply everywhere, so by default kernels alone split them)."""
        groups: dict[tuple, list[SizeRange]] = {}
        for size_range in size_ranges:
            kernels = self.gemms.decisions(graph, size_range) if graph is not None and self.gemms else ()
            groups.setdefault((self.applicable(size_range), kernels), []).append(size_range)
        return list(groups.values())

    def run(self, graph: fx.GraphModule, size_range: SizeRange) -> PassReport:
        """Apply every pass that applies to `size_range` to `graph`, in place."""
        report = PassReport()
        for p in self.passes:
            if not p.applies_to(size_range):
                continue
            start = time.perf_counter()
            if isinstance(p, Lowering):
                p.size_range = size_range
            report.matches[p.name] = self._run_user(p, graph.graph) if p in self.custom else int(p(graph.graph))
            report.seconds[p.name] = time.perf_counter() - start
            if isinstance(p, Lowering):
                report.kernel_choices = list(p.choices)
                report.gemm_choices, report.weight_formats = list(p.gemm_choices), dict(p.weight_formats)
            logger.debug("pass %s: %s matches in %.3fs", p.name, report.matches[p.name], report.seconds[p.name])
        graph.graph.lint()
        graph.recompile()
        return report

    @staticmethod
    def _run_user(p: GraphPass, graph: fx.Graph) -> int | str:
        """A user pass, its failure reported as one line that names it (the trace is logged at DEBUG)."""
        try:
            matches = p(graph)
        except Exception as e:
            logger.debug("user pass %s failed", p.name, exc_info=True)
            raise KilnError(f"user pass {p.name!r} failed: {type(e).__name__}: {e} "
                            "(run with -vv for its traceback)") from None
        if matches is None:
            return UNKNOWN
        if not isinstance(matches, int):
            raise KilnError(f"user pass {p.name!r} returned {matches!r}: `__call__` returns how many sites it "
                            "changed (an int), or None when it does not count")
        return matches
