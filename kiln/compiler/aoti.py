"""A piece compiled ahead of time by AOTInductor into one shared library, and that library loaded.

A library holds the piece's C++ wrapper and its kernels; it runs through torch's C++ runner, so
loading one imports none of Inductor's Python (its Python wrapper alone pulls in the whole
compiler: about 2 s of imports on this CPU, more than the rest of a start-up). Custom ops in the
piece (kiln's) are called through a proxy executor that reads the op calls from a JSON file beside
the library, named like it.
"""

import tempfile
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import fx

from kiln.errors import KilnError

LIBRARY_SUFFIX = ".so"
CALLS_SUFFIX = ".json"
"""The proxy executor's op-call table: `<library stem>.json`, where torch's runner looks for it."""


@dataclass(frozen=True)
class CompiledLibrary:
    """What one AOTInductor compile produced: the library bytes, its custom-op call table (None
    when the piece calls no custom op) and the generated C++ source, for people to read."""

    library: bytes
    calls: bytes | None
    sources: dict[str, str]


def tensor_args(examples: list) -> tuple[int, ...]:
    """The argument positions a library takes: the tensors. Plain-int sizes are left out; the
    library reads them off the tensors that carry them (`check_compilable` makes sure one does)."""
    return tuple(i for i, value in enumerate(examples) if isinstance(value, torch.Tensor))


def check_compilable(name: str, graph: fx.GraphModule, examples: list) -> None:
    """A library takes and returns tensors only: every symbolic int argument must be some tensor
    argument's dimension, and every output a tensor. Raises KilnError naming the piece otherwise."""
    carried = {str(s) for v in examples if isinstance(v, torch.Tensor) for s in v.shape}
    for value in examples:
        if not isinstance(value, torch.Tensor) and str(value) not in carried:
            raise KilnError(f"piece {name} takes size {value} that none of its tensor arguments carries: "
                            "AOTInductor cannot compile it; a graph pass may have moved a split point")
    output = next(n for n in reversed(graph.graph.nodes) if n.op == "output")
    for node in _flat(output.args[0]):
        value = node.meta.get("val") if isinstance(node, fx.Node) else node
        if not isinstance(value, torch.Tensor):
            raise KilnError(f"piece {name} returns {type(value).__name__} {value!r}, not a tensor: AOTInductor "
                            "libraries return tensors only")


def _flat(value) -> list:
    if isinstance(value, (tuple, list)):
        return [x for v in value for x in _flat(v)]
    return [value]


def compile_library(graph: fx.GraphModule, examples: list, fake_mode) -> CompiledLibrary:
    """Compile `graph` (changed in place) for `examples` (fake tensors; symbolic dimensions stay
    dynamic) into a library. Kernels are embedded in the library (GPU code included), so the one file is all a load needs."""
    import torch._inductor

    for node, value in zip(graph.graph.find_nodes(op="placeholder"), examples):
        node.meta["val"] = value  # a static compile's examples come from another fake mode
    output = next(n for n in reversed(graph.graph.nodes) if n.op == "output")
    if not isinstance(output.args[0], (tuple, list)):  # AOTInductor wants a tuple; the loader unwraps it
        output.args = ((output.args[0],),)
        graph.recompile()
    options = {
        "aot_inductor.package": True,  # keeps generated files in output_path, kernels in the library
        "aot_inductor.embed_kernel_binary": True,
    }
    with tempfile.TemporaryDirectory(prefix="kiln-aoti-") as tmp:
        options["aot_inductor.output_path"] = tmp
        with fake_mode, warnings.catch_warnings():
            warnings.filterwarnings("ignore", ".*LeafSpec.*", FutureWarning)  # torch's own deprecation, on deepcopy
            files = [Path(f) for f in torch._inductor.aot_compile(graph, tuple(examples), options=options)
                     if isinstance(f, str)]
        libraries = [f for f in files if f.name.endswith(".wrapper" + LIBRARY_SUFFIX)]
        if len(libraries) != 1:
            raise KilnError(f"AOTInductor produced {len(libraries)} wrapper libraries for one piece, expected 1: "
                            f"{sorted(f.name for f in files)}")
        library = libraries[0]
        calls = library.with_suffix(CALLS_SUFFIX)
        sources = {f.name.split(".", 1)[1]: f.read_text() for f in files if f.suffix == ".cpp"}
        return CompiledLibrary(library.read_bytes(), calls.read_bytes() if calls.is_file() else None, sources)


class LoadedLibrary:
    """A compiled piece, loaded: called with the piece's arguments, it runs the library on the
    tensors among them and returns the library's outputs (a list of tensors)."""

    def __init__(self, library: Path, tensor_args: tuple[int, ...], device: str = "cpu"):
        if device == "cpu":
            runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(library), 1)
        elif device.startswith("cuda") and hasattr(torch._C._aoti, "AOTIModelContainerRunnerCuda"):
            runner = torch._C._aoti.AOTIModelContainerRunnerCuda(str(library), 1, device)
        else:
            raise KilnError(f"this torch cannot run AOTInductor libraries on {device!r}")
        self._run: Callable = runner.run  # the bound method keeps the runner, and the library, loaded
        self.tensor_args = tensor_args

    def __call__(self, *args) -> list[torch.Tensor]:
        return self._run([args[i] for i in self.tensor_args])
