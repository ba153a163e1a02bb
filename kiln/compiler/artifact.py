"""The artifact format: write one, check one (`kiln.runtime.bind` loads one).

```
<cache>/<key>/
  manifest.json    format, versions, system, key factors, input contract, variants, timings
  programs/<i>.py  variant i's stitching code (plain Python calling pieces and attention in order)
  blobs/<sha>.so   one per unique compiled piece and size: AOTInductor's library, kernels inside
  blobs/<sha>.json the custom-op calls that library makes (torch's runner reads it beside the .so)
  kernels/triton/  CUDA: the Triton kernels the program launches from Python (attention, RoPE + KV
                   write), built at compile time (`triton_cache.py`) and put into Triton's cache at load
  debug/           what was compiled, as text: Dynamo's bytecode (depyf-decompiled) and graph, the
                   graphs before and after the passes, each piece, each library's generated C++
                   (`kiln cache dump` reads them)
```

A variant is the backbone as one pass pipeline shaped it, for the token counts it serves (size
ranges and static sizes). There is one unless a pass applies to some sizes only.

Loading runs neither Dynamo nor a C++ compiler, and imports none of Inductor: this module is what
the runtime may import.
"""

import hashlib
import json
import logging
import os
import platform
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch

import kiln
from kiln.compiler import atomic
from kiln.compiler.aoti import CALLS_SUFFIX, LIBRARY_SUFFIX
from kiln.compiler.counters import counters
from kiln.compiler.key import cache_key, python_version, system_info
from kiln.errors import KilnError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 4
"""4: the manifest carries a digest of its own contents."""
MANIFEST = "manifest.json"
PROGRAMS = "programs"
TRITON_KERNELS = "kernels/triton"
RECOMPILE = "run `kiln compile` again"
KEY = re.compile(r"[0-9a-f]{32}")
"""An artifact directory's name: its key."""


class ArtifactError(KilnError):
    """An artifact is missing, from another build, or damaged; the message names which and the fix."""


class ArtifactMissing(ArtifactError):
    """No artifact under this key yet (the common, unalarming case)."""


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _torch_build() -> str:
    """The commit torch was built from: libraries link against this libtorch's C++ ABI."""
    return torch.version.git_version


def _entry(path: Path) -> dict:
    """How the manifest pins a file: its sha256 and size (a size mismatch reads as truncation)."""
    return {"sha256": file_sha256(path), "bytes": path.stat().st_size}


def _blob_entries(manifest: dict) -> list[dict]:
    """Each distinct blob (library) the pieces, the LM head and the decode attention use, once
    (identical layers and variants share theirs)."""
    pieces = [e for v in manifest["variants"] for p in v["pieces"].values() for e in p["sizes"].values()]
    others = list(lm_head_libraries(manifest).values()) + list(manifest.get("libraries", {}).values())
    return list({e["sha256"]: e for e in pieces + others}.values())


HEAD_TENSOR_ARGS = (0, 1)
"""An LM head library's arguments, the rows and the packed weight: both tensors."""
BLOCKED_HEAD_TENSOR_ARGS = (0, 1, 2)
"""...and the blocked int8 GEMM's: the rows, their block scales and the packed weight."""


def lm_head_libraries(manifest: dict) -> dict[str, dict]:
    """The LM head's libraries (`kiln.compiler.libraries`): weight format -> blob entry."""
    return (manifest.get("lm_head") or {}).get("libraries") or {}


def variant_label(ranges: list, sizes: list) -> str:
    """"1-64,128": the token counts a variant serves (adjacent ranges shown as one)."""
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo == merged[-1][1] + 1:
            merged[-1][1] = hi
        else:
            merged.append([lo, hi])
    return ",".join([f"{lo}-{hi}" for lo, hi in merged] + [str(s) for s in sizes])


def pass_matches(manifest: dict) -> dict[str, dict[str, int | None]]:
    """Variant label -> pass name -> matches, as `kiln compile` reports them."""
    return {variant_label(v["ranges"], v["sizes"]): {p["name"]: p["matches"] for p in v["passes"]}
            for v in manifest["variants"]}


def _write_file(path: Path, data: bytes) -> dict:
    path.write_bytes(data)
    return _entry(path)


def save(
    path: Path,
    *,
    factors: dict,
    inputs: list[dict],
    variants: list[dict],
    info: dict,
    debug: dict[str, str] | None = None,
    head_libraries: dict | None = None,
    libraries: dict | None = None,
) -> None:
    """Write the artifact into a temporary sibling of `path`, then move it into place in one step.

    Each of `variants` has `ranges`, `sizes`, `program` (source), `passes` (report entries),
    `kernel_choices` (the lowering's measured decisions, CUDA) and `pieces`: piece name -> an object
    with `compiled` ({size or None: CompiledLibrary}), `tokens`, `returns_tuple` and `tensor_args`.
    `head_libraries` maps a weight format to the LM head's library of its GEMM (`kiln.compiler.libraries`),
    listed under info's "lm_head"; `libraries` maps a name to a library the runtime calls outside the
    pieces (`kiln.compiler.libraries`), listed as the manifest's "libraries". `debug` maps a relative path
    under debug/ -> text; each library's C++ is added under debug/inductor/.
    """
    path = Path(path)
    tmp = atomic.shareable(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))
    try:
        for folder in ("blobs", PROGRAMS):
            (tmp / folder).mkdir()
        debug = dict(debug or {})
        blob_of: dict[int, dict] = {}  # id(CompiledLibrary) -> blob entry; identical pieces share
        variant_entries = []
        for i, variant in enumerate(variants):
            entries = {}
            for name, build in variant["pieces"].items():
                sizes = {}
                for size, compiled in build.compiled.items():
                    if id(compiled) not in blob_of:
                        blob_of[id(compiled)] = _save_library(tmp / "blobs", compiled, debug)
                        counters["blobs_saved"] += 1
                    sizes["dynamic" if size is None else str(size)] = blob_of[id(compiled)]
                entries[name] = {"sizes": sizes, "tokens": build.tokens, "returns_tuple": build.returns_tuple,
                                 "tensor_args": list(build.tensor_args), "token_args": list(build.token_args)}
            program = _write_file(tmp / PROGRAMS / f"{i}.py", variant["program"].encode())
            variant_entries.append({"ranges": [list(r) for r in variant["ranges"]], "sizes": list(variant["sizes"]),
                                    "program": program, "pieces": entries, "passes": variant["passes"],
                                    "kernel_choices": variant.get("kernel_choices", []),
                                    "gemm_choices": variant.get("gemm_choices", []),
                                    "weight_formats": variant.get("weight_formats", {})})
        if head_libraries:
            info = {**info, "lm_head": {**info["lm_head"], "libraries": {
                format: _save_library(tmp / "blobs", compiled, debug) for format, compiled in head_libraries.items()}}}
        if libraries:
            info = {**info, "libraries": {name: _save_library(tmp / "blobs", compiled, debug)
                                          for name, compiled in libraries.items()}}
            counters["blobs_saved"] += len(libraries)
        debug_entries = {}
        for rel, text in sorted(debug.items()):
            (tmp / "debug" / rel).parent.mkdir(parents=True, exist_ok=True)
            debug_entries[rel] = _write_file(tmp / "debug" / rel, text.encode())
        manifest = {
            "format": FORMAT_VERSION,
            "key": path.name,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "kiln": kiln.__version__,
            "torch_build": _torch_build(),
            "platform": platform.platform(),
            "factors": factors,  # torch and Python versions, system: what verify() checks
            "inputs": inputs,
            "variants": variant_entries,
            "debug": debug_entries,
            **info,
        }
        (tmp / MANIFEST).write_text(_manifest_text(manifest))
        if path.exists():  # a broken artifact under this key
            remove(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("saved artifact %s (%d variants, %d blobs)", path, len(variant_entries),
                len(blob_of) + len(head_libraries or {}) + len(libraries or {}))


DIGEST = "digest"
"""The manifest's field that holds the sha256 of the rest of it, in canonical form."""


def _canonical_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != DIGEST}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _manifest_text(manifest: dict) -> str:
    """The manifest as written: its digest covers every other field, so an edit that leaves valid JSON
    reads as damage, not as another build."""
    return json.dumps({**manifest, DIGEST: _canonical_digest(manifest)}, indent=1, sort_keys=True) + "\n"


def write_manifest(path: Path, manifest: dict) -> None:
    """Replace the manifest of the artifact at `path` in one step, its digest recomputed."""
    atomic.write_bytes(Path(path) / MANIFEST, _manifest_text(manifest).encode())


def parse_manifest(data: bytes, where: Path) -> dict:
    """A manifest's contents, checked: JSON, this format, and its digest. Raises ArtifactError naming
    what is wrong."""
    try:
        manifest = json.loads(data)
    except (ValueError, UnicodeDecodeError) as e:
        raise ArtifactError(f"artifact manifest {where} is unreadable ({e}): {RECOMPILE}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise ArtifactError(f"artifact {where.parent} has format {found}, this kiln reads format {FORMAT_VERSION}: "
                            f"{RECOMPILE}")
    if manifest.get(DIGEST) != _canonical_digest(manifest):
        raise ArtifactError(f"artifact manifest {where} is damaged (its contents do not match its digest): {RECOMPILE}")
    return manifest


def key_problem(manifest: dict, key: str) -> str | None:
    """Why an artifact filed under `key` is not the build its manifest describes (its factors hash to
    another key: renamed, or copied from another key's directory), or None."""
    try:
        actual = cache_key(manifest["factors"])
    except (KeyError, TypeError, ValueError) as e:
        return f"its manifest lacks its key factors ({e})"
    if actual != key or manifest.get("key") != key:
        return (f"it is filed under {key} but its manifest says {manifest.get('key')} and its factors hash to "
                f"{actual}: it was renamed or edited")
    return None


def factor_mismatch(found: dict, expected: dict, prefix: str = "") -> str | None:
    """The first key factor where an artifact's `found` factors differ from the `expected` ones, as
    "model.rms_norm_eps: artifact 0.5, here 1e-06"; None where they agree."""
    for name in sorted(set(found) | set(expected)):
        a, b = found.get(name, "absent"), expected.get(name, "absent")
        if isinstance(a, dict) and isinstance(b, dict):
            inner = factor_mismatch(a, b, f"{prefix}{name}.")
            if inner is not None:
                return inner
        elif a != b:
            return f"{prefix}{name}: artifact {json.dumps(a)}, here {json.dumps(b)}"
    return None


def add_triton_kernels(path: Path, packed: Path, triton_version: str, seconds: float,
                       backend: str | None = None) -> int:
    """Add the Triton kernels packed under `packed` (`triton_cache.pack`) to the artifact at `path`
    and pin them in its manifest, with the `backend` they were built for (`triton_cache.backend_key`)
    and the TRITON_* variables they were built under; returns how many files. The files are copied
    first and the manifest is replaced in one step after: until then the artifact is whole, only
    without them."""
    path = Path(path)
    manifest = read_manifest(path)
    target = path / TRITON_KERNELS
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(packed, target)
    files = {p.relative_to(target).as_posix(): _entry(p) for p in sorted(target.rglob("*")) if p.is_file()}
    env = {k: v for k, v in sorted(os.environ.items()) if k.startswith("TRITON_") and k != "TRITON_CACHE_DIR"}
    manifest["triton_kernels"] = {"triton": triton_version, "files": files, "env": env}
    if backend is not None:
        manifest["triton_kernels"]["backend"] = backend
    manifest.setdefault("timings", {})["triton_kernels"] = seconds
    write_manifest(path, manifest)
    return len(files)


def install_triton_kernels(path: Path, manifest: dict) -> int:
    """Put the artifact's Triton kernels into this machine's Triton cache, so their first launch
    compiles nothing; from here on, count the kernels Triton does compile. Returns how many were added
    (0 when they are there already, or were built by another Triton or ptxas: those compile at first
    launch, and a warning says why)."""
    from kiln.compiler import triton_cache

    triton_cache.watch()
    kernels = manifest.get("triton_kernels") or {}
    if not kernels.get("files"):
        return 0
    import triton

    if kernels["triton"] != triton.__version__:
        logger.warning("the artifact's Triton kernels were built by triton %s, this is %s: they compile at first "
                       "launch; run `kiln compile --force` here to ship this Triton's", kernels["triton"],
                       triton.__version__)
        return 0
    if kernels.get("backend") is not None and (here := triton_cache.backend_key()) != kernels["backend"]:
        if triton_cache.tools_changed_since_start():  # a compiling process: Inductor moved TRITON_PTXAS_PATH
            logger.info("Triton kernels: the artifact's were built with %s as a fresh process will run them; this "
                        "process now has %s", triton_cache.describe_backend(kernels["backend"]),
                        triton_cache.describe_backend(here))
            return 0
        ptxas = os.environ.get("TRITON_PTXAS_PATH")
        fix = (f"TRITON_PTXAS_PATH is {ptxas} here: unset it, or point it at the ptxas `kiln compile` used"
               if ptxas else "run `kiln compile --force` in this environment to ship kernels for it")
        logger.warning("the artifact's Triton kernels were built with %s, this process has %s: they compile at "
                       "first launch; %s", triton_cache.describe_backend(kernels["backend"]),
                       triton_cache.describe_backend(here), fix)
        return 0
    added = triton_cache.install(Path(path) / TRITON_KERNELS)
    logger.info("Triton kernels: %d from the artifact added to %s", added, triton_cache.cache_dir())
    return added


def _save_library(blobs: Path, compiled, debug: dict[str, str]) -> dict:
    """Write one library as blobs/<sha256>.so (and its call table beside it); add its C++ to
    `debug`; return its manifest entry."""
    staged = blobs / f"staged{LIBRARY_SUFFIX}"
    staged.write_bytes(compiled.library)
    entry = _entry(staged)
    library = blobs / f"{entry['sha256']}{LIBRARY_SUFFIX}"
    os.replace(staged, library)
    entry["calls"] = None if compiled.calls is None else _write_file(library.with_suffix(CALLS_SUFFIX), compiled.calls)
    for name, text in compiled.sources.items():
        debug[f"inductor/{entry['sha256'][:16]}/{name}"] = text
    return entry


def remove(path: Path) -> None:
    """Delete the artifact at `path`: one rename takes it from its key, then it is deleted, so a
    crash leaves no half-deleted artifact under the key (only a hidden `.stale-*` directory)."""
    stale = Path(tempfile.mkdtemp(prefix=f".stale-{path.name}-", dir=path.parent))
    os.replace(path, stale / path.name)
    shutil.rmtree(stale, ignore_errors=True)


def read_manifest(path: Path, check_key: bool = True) -> dict:
    """The manifest of the artifact at `path` (`parse_manifest`'s checks); with `check_key`, also that
    a directory named like a key is the one its factors hash to."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise ArtifactMissing(f"no artifact at {path}: run `kiln compile MODEL_DIR` to build it")
    try:
        data = (path / MANIFEST).read_bytes()
    except OSError as e:
        raise ArtifactError(f"artifact manifest {path / MANIFEST} is unreadable ({e}): {RECOMPILE}") from None
    manifest = parse_manifest(data, path / MANIFEST)
    if check_key and KEY.fullmatch(path.name) and (problem := key_problem(manifest, path.name)) is not None:
        raise ArtifactError(f"artifact {path}: {problem}; {RECOMPILE}")
    return manifest


def _file_problem(path: Path, entry: dict, what: str) -> str | None:
    if not path.is_file():
        return f"artifact {what} {path} is missing"
    size = path.stat().st_size
    if size != entry["bytes"]:
        return f"artifact {what} {path} is truncated or altered ({size} bytes, expected {entry['bytes']})"
    if file_sha256(path) != entry["sha256"]:
        return f"artifact {what} {path} is corrupt (sha256 mismatch)"
    return None


def pinned_files(path: Path, manifest: dict) -> list[tuple[Path, dict, str]]:
    """Every file the manifest pins: (path, entry, what it is)."""
    files = [(path / PROGRAMS / f"{i}.py", v["program"], "program") for i, v in enumerate(manifest["variants"])]
    for e in _blob_entries(manifest):
        files.append((blob_path(path, e), e, "blob"))
        if e["calls"] is not None:
            files.append((blob_path(path, e).with_suffix(CALLS_SUFFIX), e["calls"], "blob call table"))
    files += [(path / TRITON_KERNELS / rel, e, "Triton kernel")
              for rel, e in manifest.get("triton_kernels", {}).get("files", {}).items()]
    files += [(path / "debug" / rel, e, "debug file") for rel, e in manifest.get("debug", {}).items()]
    return files


def file_problems(path: Path, manifest: dict, first_only: bool = False) -> list[str]:
    """Re-hash every file the manifest pins; one message per missing, truncated or corrupt file."""
    problems = []
    try:
        for file, entry, what in pinned_files(Path(path), manifest):
            problem = _file_problem(file, entry, what)
            if problem:
                problems.append(problem)
                if first_only:
                    break
    except (KeyError, TypeError, AttributeError) as e:
        problems.append(f"artifact manifest {Path(path) / MANIFEST} lacks or mangles {e}")
    return problems


def compatibility_problem(manifest: dict) -> str | None:
    """Why an artifact built elsewhere cannot load here (torch, Python, system) and the fix, or None."""
    try:
        factors = manifest["factors"]
        if factors["torch"] != torch.__version__:
            return f"artifact built with torch {factors['torch']}, this is {torch.__version__}: {RECOMPILE}"
        if manifest["torch_build"] != _torch_build():
            return f"artifact built with another build of torch {torch.__version__} (its sources differ): {RECOMPILE}"
        if factors["python"] != python_version():
            return f"artifact built for Python {factors['python']}, this is {python_version()}: {RECOMPILE}"
        here = system_info(factors["system"]["device"])
        if factors["system"] != here:
            return (f"artifact built for {factors['system']}, this machine is {here}: run `kiln compile` on a "
                    "machine like this one")
    except (KeyError, TypeError, AttributeError) as e:
        return f"artifact manifest lacks or mangles {e}: {RECOMPILE}"
    return None


def verify(path: Path, factors: dict | None = None) -> dict:
    """Check that the artifact at `path` can be loaded here: format, the manifest's digest, versions,
    system, that its factors are the caller's `factors` (where given) and hash to its key, and every
    file's size and sha256. Returns the manifest; raises ArtifactError naming the first problem."""
    path = Path(path)
    manifest = read_manifest(path, check_key=False)
    problem = compatibility_problem(manifest)
    if problem is not None:
        raise ArtifactError(problem)
    if factors is not None and (differs := factor_mismatch(manifest.get("factors") or {}, factors)) is not None:
        raise ArtifactError(f"artifact {path} was built for another model or configuration ({differs}): {RECOMPILE}")
    if KEY.fullmatch(path.name) and (problem := key_problem(manifest, path.name)) is not None:
        raise ArtifactError(f"artifact {path}: {problem}; {RECOMPILE}")
    for problem in file_problems(path, manifest, first_only=True):
        raise ArtifactError(f"{problem}: {RECOMPILE}")
    return manifest


def blob_path(path: Path, entry: dict) -> Path:
    """Where the library a manifest blob entry pins lives."""
    return Path(path) / "blobs" / f"{entry['sha256']}{LIBRARY_SUFFIX}"
