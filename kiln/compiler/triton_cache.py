"""The Triton kernels a program launches from Python, built by `kiln compile` and shipped in the
artifact, so that a GPU serve start compiles none.

Inductor's kernels live inside the AOTInductor libraries. kiln's paged attention and RoPE + KV-write
kernels do not: the program launches them through their ops, and Triton compiles each
specialization at its first launch (about a second each) into its cache, `<cache>/<hash>/`.
`Recorder` notes every kernel Triton compiles or finds there while a warm-up run launches them;
`pack` keeps each one's binary and metadata; `install` puts them into this machine's Triton cache,
where the first launch finds them. The hash covers Triton's version, the GPU architecture, ptxas
and the options, so on another setup nothing matches and the kernels compile at first launch, as
they would without the artifact; `watch` counts such compiles (`triton_kernels_compiled`).

The ptxas a process uses depends on TRITON_PTXAS_PATH, which Inductor sets in a compiling process
(to torch's own ptxas) and a serve process, which never imports Inductor, does not see. So the
warm-up runs `as_fresh_process()`, and the manifest records the `backend_key` it built under.

Triton is imported only when these functions run: a CPU process never pays for it.
"""

import json
import logging
import os
import re
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kiln.compiler import atomic
from kiln.compiler.counters import counters

logger = logging.getLogger(__name__)

KEPT_SUFFIXES = (".cubin", ".hsaco", ".json")
"""What a launch needs of a cache entry: the binary and its metadata (Triton's own
TRITON_STORE_BINARY_ONLY keeps the same); the IR files are ten times their size."""
GROUP_PREFIX = "__grp__"


class Recorder:
    """Within `with Recorder() as r:`, every kernel Triton compiles (`r.compiled`) or loads from its
    cache (`r.builds`, both: Triton's cache entry, named by its hash -> the entry's files, name ->
    path). Triton reports only what its in-memory cache misses: call
    `forget_launched()` first to see kernels this process launched before."""

    def __init__(self):
        self.builds: dict[str, dict[str, str]] = {}
        self.compiled: list[str] = []

    def __enter__(self) -> "Recorder":
        import triton

        self._knobs = triton.knobs.compilation
        self._previous = self._knobs.listener
        self._knobs.listener = self._listen
        return self

    def __exit__(self, *exc) -> None:
        self._knobs.listener = self._previous

    def _listen(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        if self._previous is not None:
            self._previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)
        files = dict(metadata_group)
        self.builds[Path(next(iter(files.values()))).parent.name] = files
        if not cache_hit:
            self.compiled.append(src.name)


def forget_launched() -> None:
    """Drop kiln's kernels from Triton's in-memory cache, so their next launch asks the compiler
    (and a `Recorder` sees it)."""
    from triton.runtime.jit import JITFunction

    for name, module in list(sys.modules.items()):
        if not name.startswith("kiln.kernels.triton."):
            continue
        for value in list(vars(module).values()):
            if isinstance(value, JITFunction) and hasattr(value, "device_caches"):
                value.device_caches.clear()


def pack(builds: dict[str, dict[str, str]], dest: Path) -> list[str]:
    """Copy each recorded entry's binary and metadata into `dest/<hash>/`; returns the relative paths
    written."""
    written = []
    for entry, files in builds.items():
        for name, src in sorted(files.items()):
            if not name.endswith(KEPT_SUFFIXES) or name.startswith(GROUP_PREFIX):
                continue
            target = Path(dest) / entry / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, target)
            written.append(f"{entry}/{name}")
    return written


def cache_dir() -> Path:
    """This process's Triton cache (`$TRITON_CACHE_DIR`, else Triton's default)."""
    import triton

    return Path(triton.knobs.cache.dir)


def install(src: Path, dest: Path | None = None) -> int:
    """Put the packed kernels under `src` into Triton's cache (or `dest`): each entry's files, then
    its group file naming them at their new paths (Triton's lookup reads the group, so a reader never
    sees a half-installed entry). Entries already there are left alone. Returns how many were added."""
    dest = Path(dest) if dest is not None else cache_dir()
    added = 0
    for entry in sorted(p for p in Path(src).iterdir() if p.is_dir()):
        files = sorted(p.name for p in entry.iterdir() if p.is_file())
        metadata = [name for name in files if name.endswith(".json")]
        if len(metadata) != 1:
            logger.warning("skipping Triton kernel %s in the artifact: expected one metadata file, found %s",
                           entry.name, metadata)
            continue
        target = dest / entry.name
        group = target / f"{GROUP_PREFIX}{metadata[0]}"
        if group.is_file() and all((target / name).is_file() for name in files):
            continue
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            atomic.write_bytes(target / name, (entry / name).read_bytes())
        atomic.write_bytes(group, json.dumps({"child_paths": {name: str(target / name) for name in files}}).encode())
        added += 1
    return added


_watching = False
compiled_kernels: list[dict] = []
"""What `watch` saw Triton compile: each kernel's name, cache entry and specialization (to tell why a
shipped kernel did not match)."""


def watch() -> None:
    """From now on count (`triton_kernels_compiled`) and log each Triton kernel this process
    compiles rather than finds in its cache: after `install`, a serve start should count none."""
    global _watching
    if _watching:
        return
    import triton

    compilation = triton.knobs.compilation
    previous = compilation.listener

    def listen(*, src, metadata, metadata_group, times, cache_hit) -> None:
        if previous is not None:
            previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)
        if not cache_hit:
            counters["triton_kernels_compiled"] += 1
            entry = Path(next(iter(dict(metadata_group).values()))).parent.name
            compiled_kernels.append({"name": src.name, "entry": entry, "attrs": repr(getattr(src, "attrs", None)),
                                     "constants": repr(getattr(src, "constants", None))})
            logger.info("Triton compiled kernel %s (it was not in the artifact, or was built by another Triton "
                        "or GPU)", src.name)

    compilation.listener = listen
    _watching = True


def backend_key(target=None) -> str:
    """What Triton's cache key takes from the compiler backend of `target` (default: this process's
    GPU): on CUDA, ptxas's version and the architecture. A kernel built under another key is not
    found by a lookup here: it compiles again."""
    from triton.compiler.compiler import make_backend
    from triton.runtime import driver

    return make_backend(target or driver.active.get_current_target()).hash()


def describe_backend(key: str) -> str:
    """A backend key in a few words ("ptxas 12.8.93, sm_90"), for messages."""
    version, arch = re.search(r"\bV(\d+(?:\.\d+)+)", key), re.search(r"-(\d+)\s*$", key)
    if version is None:
        return key.strip().splitlines()[0][:80] if key.strip() else "an unknown backend"
    return f"ptxas {version.group(1)}" + (f", sm_{arch.group(1)}" if arch else "")


def startup_environ() -> dict[str, str]:
    """This process's environment as it started (Linux's /proc/self/environ): what a fresh process
    started from the same shell sees, before Inductor set anything. The current one without /proc."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return dict(os.environ)
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {key: value for key, _, value in pairs}


def _tool_variables(env: dict[str, str]) -> dict[str, str]:
    """The TRITON_*_PATH variables (ptxas, cuobjdump, libdevice...) of `env`: what names the tools
    that build a kernel, and so enters its cache key."""
    return {k: v for k, v in env.items() if k.startswith("TRITON_") and k.endswith("_PATH")}


@contextmanager
def as_fresh_process() -> Iterator[None]:
    """Within: Triton's tool variables as this process started, and Triton's remembered ptxas
    version forgotten, so kernels are built as a fresh `kiln serve` will look them up."""
    now, started = _tool_variables(dict(os.environ)), _tool_variables(startup_environ())
    _set_tool_variables(started)
    try:
        yield
    finally:
        _set_tool_variables(now)


def tools_changed_since_start() -> bool:
    """Whether this process has changed Triton's tool variables since it started (Inductor does, in
    a process that compiles): then kernels it built before (as a fresh process would) are already
    in memory, and a lookup under its current ptxas says nothing about a fresh serve."""
    return _tool_variables(dict(os.environ)) != _tool_variables(startup_environ())


def _set_tool_variables(env: dict[str, str]) -> None:
    for key in _tool_variables(dict(os.environ)).keys() - env.keys():
        del os.environ[key]
    os.environ.update(env)
    try:
        from triton.backends.nvidia import compiler
    except ImportError:
        return
    remembered = getattr(compiler, "get_ptxas_version", None)  # Triton caches it for the process's life
    if hasattr(remembered, "cache_clear"):
        remembered.cache_clear()
