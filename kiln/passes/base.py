"""The pass-authoring API: `GraphPass` for any graph rewrite, `PatternPass` for pattern -> replacement.

Passes run on kiln's traced backbone before it is split: one aten-level FX graph in which every kiln
op (`torch.ops.kiln.*.default`) is a single node and each node's `meta["val"]` holds a fake tensor.
A pass's `uuid()` is part of the artifact key, so editing a pass rebuilds the artifacts it shaped.
"""

import functools
import hashlib
import inspect
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import fx

from kiln.errors import KilnError

SizeRange = tuple[int, int]
"""Token counts [low, high], both inclusive, that one compiled graph serves."""


def source_hash(obj: type) -> str:
    """sha256 of the module that defines `obj` (all of it: helpers beside the class count too)."""
    module = sys.modules.get(obj.__module__)
    try:
        text = inspect.getsource(module) if module is not None else inspect.getsource(obj)
    except (OSError, TypeError):  # defined in a REPL or a notebook: the class body is all there is
        try:
            text = inspect.getsource(obj)
        except (OSError, TypeError):
            raise KilnError(f"the source of pass {obj.__qualname__} cannot be read (defined in `python -c` or at "
                            "an interactive prompt?), and its source is what names its artifacts: define it in a "
                            "file, or give it a uuid() of its own") from None
    return hashlib.sha256(f"{obj.__module__}.{obj.__qualname__}\n{text}".encode()).hexdigest()[:16]


class GraphPass:
    """A rewrite of the traced graph. Subclasses implement `__call__(graph) -> matches`.

    `name` labels the pass in `kiln compile`'s table and the manifest; `uuid()` defaults to a hash of
    the pass's module source; `applies_to(size_range)` lets a pass that only pays off for some batch
    sizes opt out of the others.
    """

    @property
    def name(self) -> str:
        return type(self).__name__

    def __call__(self, graph: fx.Graph) -> int:
        """Rewrite `graph` in place; return how many sites it changed."""
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(graph) -> int")

    def config(self) -> dict[str, Any]:
        """The settings that change what this pass does, as JSON data, for `uuid()`: by default the
        constructor's arguments, read back from the attributes of the same names."""
        params = inspect.signature(type(self).__init__).parameters
        return {name: getattr(self, name) for name in params if name != "self" and hasattr(self, name)}

    def uuid(self) -> str:
        """Source and configuration: two configurations of one pass class never share artifacts."""
        config = self.config()
        try:
            text = json.dumps(config, sort_keys=True)
        except TypeError:
            raise KilnError(f"pass {self.name!r}: config() gave {config!r}, which is not JSON data; override "
                            "config() to return the settings that change what the pass does as numbers, strings "
                            "and lists") from None
        return hashlib.sha256(f"{source_hash(type(self))}\n{text}".encode()).hexdigest()[:16]

    def applies_to(self, size_range: SizeRange) -> bool:
        return True


class Pattern(NamedTuple):
    """One rewrite rule: `search` and `replace` take the same arguments; `example_inputs` trace
    them (tensors, in the order of the functions' tensor parameters); `scalars` gives the value to
    trace each non-tensor parameter with (it then matches any value, and `replace` receives it)."""

    search: Callable
    replace: Callable
    example_inputs: Sequence[Any]
    scalars: dict[str, float | int] = {}


class PatternPass(GraphPass):
    """A pass made of `Pattern`s, matched with Inductor's pattern matcher.

    Override `patterns()`, or set the `pattern` and `replacement` methods and `example_inputs()` for
    a single rule. A pattern's intermediate values must have no other users, or it does not match.
    """

    def patterns(self) -> list[Pattern]:
        return [Pattern(self.pattern, self.replacement, self.example_inputs())]

    def pattern(self, *args):
        raise NotImplementedError(f"{type(self).__name__} must define pattern() or patterns()")

    def replacement(self, *args):
        raise NotImplementedError(f"{type(self).__name__} must define replacement() or patterns()")

    def example_inputs(self) -> Sequence[Any]:
        raise NotImplementedError(f"{type(self).__name__} must define example_inputs() or patterns()")

    @functools.cached_property
    def _matcher(self):
        """The patterns, traced and registered once per pass object (on first use: Inductor's import)."""
        from torch._inductor.pattern_matcher import PatternMatcherPass, fwd_only, register_replacement

        matcher = PatternMatcherPass(pass_name=self.name)
        for p in self.patterns():
            register_replacement(p.search, p.replace, list(p.example_inputs), fwd_only, matcher,
                                 scalar_workaround=dict(p.scalars) or None)
        return matcher

    def __call__(self, graph: fx.Graph) -> int:
        return self._matcher.apply(graph)


def count_ops(graph: fx.Graph, op: torch._ops.OpOverloadPacket) -> int:
    """How many nodes call `op` (any overload): what tests and reports count after a pass."""
    return sum(1 for n in graph.nodes if n.op == "call_function"
               and getattr(n.target, "overloadpacket", n.target) is op)
