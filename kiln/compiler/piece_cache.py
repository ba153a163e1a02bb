"""Compiled pieces kept across artifacts, by what was compiled.

Inductor's FX graph cache skips AOTInductor compiles, so without this every artifact would rebuild
pieces another artifact already built: the same model with another static size, a user pass that
leaves most layers alone, the same checkpoint in another cache directory. An entry is keyed by the
piece's normalized code, its example inputs (dtypes, devices, shapes and strides with symbols
renamed in order of appearance, and each symbol's value range), torch's build, Inductor's config and
kiln's compiler sources; it holds the library, its op-call table, their sha256 and the C++ source.

Entries live in `<cache>/pieces/<key>/` (`$KILN_PIECE_CACHE` moves them; `off` turns the cache
off). Each appears in one `os.replace`; a damaged one (a checksum that does not match) is removed
and compiled again.
"""

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from torch import fx

from kiln.compiler import atomic
from kiln.compiler.aoti import CompiledLibrary
from kiln.compiler.key import kiln_source_hash, python_version, system_info

logger = logging.getLogger(__name__)

ENV = "KILN_PIECE_CACHE"
FOLDER = "pieces"
_LIBRARY, _CALLS, _ENTRY = "library.so", "calls.json", "entry.json"
_SYMBOL = re.compile(r"\b[su]\d+\b")


def _symbols_renamed(examples: list) -> dict[str, str]:
    """Each symbol in the examples' sizes and strides, named by order of first appearance: two
    traces of one graph number their symbols differently."""
    names: dict[str, str] = {}
    for value in examples:
        sizes = [*value.shape, *value.stride()] if isinstance(value, torch.Tensor) else [value]
        for size in sizes:
            for name in _SYMBOL.findall(str(size)) if isinstance(size, torch.SymInt) else ():
                names.setdefault(name, f"s{len(names)}")
    return names


def _size(value, names: dict[str, str]) -> int | str:
    if not isinstance(value, torch.SymInt):
        return int(value)
    return _SYMBOL.sub(lambda m: names[m.group(0)], str(value))


def _ranges(examples: list, names: dict[str, str]) -> dict[str, str]:
    """The value range each symbol was traced with: Inductor may specialize code on it."""
    out: dict[str, str] = {}
    for value in examples:
        sizes = [*value.shape, *value.stride()] if isinstance(value, torch.Tensor) else [value]
        for size in sizes:
            if not isinstance(size, torch.SymInt):
                continue
            env = size.node.shape_env
            for symbol in size.node.expr.free_symbols:
                vr = env.var_to_range.get(symbol)
                out[names.get(str(symbol), str(symbol))] = f"[{vr.lower}, {vr.upper}]" if vr is not None else "?"
    return dict(sorted(out.items()))


def piece_cache_key(graph: fx.GraphModule, examples: list) -> str:
    """The key of compiling `graph` (normalized: inputs arg0.., values v0..) for `examples`."""
    import torch._inductor.config as inductor_config

    names = _symbols_renamed(examples)
    inputs = []
    for value in examples:
        if isinstance(value, torch.Tensor):
            inputs.append({"dtype": str(value.dtype), "device": value.device.type,
                           "shape": [_size(s, names) for s in value.shape],
                           "stride": [_size(s, names) for s in value.stride()]})
        else:
            inputs.append(_size(value, names))
    constants = [node.target for node in graph.graph.nodes if node.op == "get_attr"]
    factors = {
        "code": graph.code,
        "inputs": inputs,
        "ranges": _ranges(examples, names),
        "constants": {name: hashlib.sha256(_bytes(getattr(graph, name))).hexdigest() for name in constants},
        "system": system_info(next((str(v.device) for v in examples if isinstance(v, torch.Tensor)), "cpu")),
        "torch": torch.version.git_version,
        "python": python_version(),
        "inductor_config": inductor_config.get_hash().hex(),
        "kiln_source": kiln_source_hash(),
    }
    return hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:32]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _bytes(value) -> bytes:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return repr(value).encode()


class PieceCache:
    """Compiled libraries by `piece_cache_key`, in a folder; reads can be skipped (`--force`)."""

    def __init__(self, root: Path, read: bool = True):
        self.root = Path(root)
        self.read = read

    @staticmethod
    def for_cache_dir(cache_dir: Path, read: bool = True) -> "PieceCache | None":
        """The piece cache beside the artifacts in `cache_dir`, or where `$KILN_PIECE_CACHE` says
        (None when it says `off`)."""
        where = os.environ.get(ENV, "")
        if where.lower() in ("off", "0", "none"):
            return None
        return PieceCache(Path(where).expanduser() if where else Path(cache_dir) / FOLDER, read)

    def get(self, key: str) -> CompiledLibrary | None:
        """The entry, or None if there is none or it is damaged (then it is removed, to be rewritten)."""
        if not self.read:
            return None
        entry = self.root / key
        if not entry.is_dir():
            return None
        try:
            meta = json.loads((entry / _ENTRY).read_text())
            library = (entry / _LIBRARY).read_bytes()
            calls = (entry / _CALLS).read_bytes() if meta["calls"] is not None else None
            if _sha(library) != meta["library"] or (calls is not None and _sha(calls) != meta["calls"]):
                raise ValueError("checksum mismatch")
            os.utime(entry)  # a hit is a use: prune by age keeps what is used
            return CompiledLibrary(library, calls, meta["sources"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("compiled piece %s in %s is damaged (%s): compiling it again", key[:12], self.root, e)
            shutil.rmtree(entry, ignore_errors=True)
            return None

    def entries(self) -> list[tuple[Path, float, int]]:
        """(folder, last use, bytes) of each entry and each leftover of a killed write."""
        out = []
        for entry in self.root.iterdir() if self.root.is_dir() else ():
            if entry.is_dir():
                size = sum(f.stat().st_size for f in entry.rglob("*") if f.is_file())
                out.append((entry, entry.stat().st_mtime, size))
        return out

    def put(self, key: str, compiled: CompiledLibrary) -> None:
        """Store an entry in one rename. A failure costs only the reuse, so it is logged, not raised."""
        entry = self.root / key
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = atomic.shareable(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=self.root))
        except OSError as e:
            logger.warning("could not keep compiled piece %s in %s: %s", key[:12], self.root, e)
            return
        try:
            (tmp / _LIBRARY).write_bytes(compiled.library)
            if compiled.calls is not None:
                (tmp / _CALLS).write_bytes(compiled.calls)
            meta = {"library": _sha(compiled.library), "calls": None if compiled.calls is None else _sha(compiled.calls),
                    "sources": compiled.sources}
            (tmp / _ENTRY).write_text(json.dumps(meta))
            if entry.exists() and not self.read:  # --force: the new compile replaces the old
                shutil.rmtree(entry, ignore_errors=True)
            if not entry.exists():  # else a concurrent compile of the same piece stored it first
                os.replace(tmp, entry)
        except OSError as e:
            logger.warning("could not keep compiled piece %s in %s: %s", key[:12], self.root, e)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
