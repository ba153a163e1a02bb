"""A piece compiled ahead of time by AOTInductor into one shared library, and that library loaded.

A library holds the piece's C++ wrapper and its kernels; it runs through torch's C++ runner, so
loading one imports none of Inductor's Python (its Python wrapper alone pulls in the whole
compiler: seconds of imports, more than the rest of a start-up). Custom ops in the
piece (kiln's, but for the projections: `kiln.kernels.onednn_lowering`, `kiln.kernels.cpp_lowering`)
are called through a proxy executor that reads the op calls from a JSON file beside the library,
named like it.
"""

import json
import struct
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

    from kiln.kernels import cpp_lowering, onednn_lowering

    onednn_lowering.register()  # kiln's oneDNN ops as C shim calls, not proxy calls
    cpp_lowering.register()  # kiln's panel GEMM compiled into the piece
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
        table = calls.read_bytes() if calls.is_file() else None
        if table is not None and PROXY_EXECUTOR_CASTS_DTYPES:
            table = c10_dtype_numbers(table)
        binary = library.read_bytes()
        check_shared_cxx_runtime(binary)
        return CompiledLibrary(binary, table, sources)


CXX_RUNTIMES = ("libstdc++.so", "libc++.so")


def check_shared_cxx_runtime(binary: bytes) -> None:
    """Refuse a library that carries its own copy of the C++ runtime: torch's runner, in a process
    whose libstdc++ is the shared one, crashes loading it (its `std::regex` meets two `std::locale`s;
    seen on a machine whose `$CXX` was a g++ built with a static libstdc++ only)."""
    needed = needed_libraries(binary)
    if needed is not None and not any(name.startswith(CXX_RUNTIMES) for name in needed):
        from torch._inductor.cpp_builder import get_cpp_compiler

        raise KilnError(f"the C++ compiler {get_cpp_compiler()} linked the C++ runtime into an AOTInductor library "
                        f"statically (it needs only {', '.join(needed)}): torch crashes loading such a library. "
                        "Set CXX to a compiler that links libstdc++ as a shared library (the system's g++, "
                        "e.g. CXX=/usr/bin/g++) and compile again")


def needed_libraries(binary: bytes) -> list[str] | None:
    """The shared libraries a 64-bit little-endian ELF file names as NEEDED, read from its dynamic
    section (no binutils needed); None for any other kind of file."""
    if binary[:6] != b"\x7fELF\x02\x01":
        return None
    section_offset, = struct.unpack_from("<Q", binary, 0x28)
    entry_size, count = struct.unpack_from("<HH", binary, 0x3A)
    # Elf64_Shdr: name, type, flags, addr, offset, size, link, info, addralign, entsize
    sections = [struct.unpack_from("<IIQQQQIIQQ", binary, section_offset + i * entry_size) for i in range(count)]
    dynamic = next((s for s in sections if s[1] == 6), None)  # SHT_DYNAMIC
    if dynamic is None:
        return []
    strings = sections[dynamic[6]][4]
    needed = []
    for offset in range(dynamic[4], dynamic[4] + dynamic[5], 16):
        tag, value = struct.unpack_from("<qQ", binary, offset)
        if tag == 0:  # DT_NULL
            break
        if tag == 1:  # DT_NEEDED
            start = strings + value
            needed.append(binary[start:binary.index(b"\0", start)].decode())
    return needed


PROXY_EXECUTOR_CASTS_DTYPES = torch.torch_version.TorchVersion(torch.__version__) < (2, 12)
"""torch 2.11's proxy executor casts a dtype argument's number in the call table (torch.export's
numbering: float32 is 7) straight to a c10 ScalarType (where 7 is float64): pytorch#169157, fixed in
2.12. Seen here: kiln's `scaled_mm(..., out_dtype=float32)` returned float64 under 2.11."""

C10_SCALAR_TYPES = {
    torch.uint8: 0, torch.int8: 1, torch.int16: 2, torch.int32: 3, torch.int64: 4, torch.float16: 5,
    torch.float32: 6, torch.float64: 7, torch.bool: 11, torch.bfloat16: 15, torch.float8_e5m2: 23,
    torch.float8_e4m3fn: 24, torch.float8_e5m2fnuz: 25, torch.float8_e4m3fnuz: 26,
}
"""c10's ScalarType numbers (c10/core/ScalarType.h), which its serialized formats fix."""


def c10_dtype_numbers(table: bytes) -> bytes:
    """The call table with each dtype argument renumbered from torch.export's numbering to c10's:
    what a proxy executor that casts the number reads as the intended dtype."""
    from torch._export.serde.serialize import _TORCH_TO_SERIALIZE_DTYPE

    renumber = {_TORCH_TO_SERIALIZE_DTYPE[dtype].value: c10 for dtype, c10 in C10_SCALAR_TYPES.items()}

    def visit(value):
        if isinstance(value, dict):
            if "as_scalar_type" in value:
                number = value["as_scalar_type"]
                if number not in renumber:
                    raise KilnError(f"a custom op in this piece takes a dtype (serialized as {number}) that torch "
                                    f"{torch.__version__}'s AOTInductor passes wrongly: use torch 2.12 or newer")
                return {**value, "as_scalar_type": renumber[number]}
            return {k: visit(v) for k, v in value.items()}
        if isinstance(value, list):
            return [visit(v) for v in value]
        return value

    return json.dumps(visit(json.loads(table))).encode()


CUDA_GRAPH_SAFE = True
"""The CUDA runner's `run_single_threaded`: skip the model container's bookkeeping, which queries a
CUDA event before each run (illegal while a CUDA graph is being captured) and records one in the
stream (a captured event, which the next query rejects). kiln runs each library from one thread."""


class LoadedLibrary:
    """A compiled piece, loaded: called with the piece's arguments, it runs the library on the
    tensors among them and returns the library's outputs (a list of tensors)."""

    def __init__(self, library: Path, tensor_args: tuple[int, ...], device: str = "cpu"):
        if device == "cpu":
            runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(library), 1)
        elif device.startswith("cuda") and hasattr(torch._C._aoti, "AOTIModelContainerRunnerCuda"):
            runner = torch._C._aoti.AOTIModelContainerRunnerCuda(str(library), 1, device, "", CUDA_GRAPH_SAFE)
        else:
            raise KilnError(f"this torch cannot run AOTInductor libraries on {device!r}")
        self._run: Callable = runner.run  # the bound method keeps the runner, and the library, loaded
        self.tensor_args = tensor_args

    def __call__(self, *args) -> list[torch.Tensor]:
        return self._run([args[i] for i in self.tensor_args])
