"""Built C++ kernels, kept by content so an artifact loads without a C++ compiler.

Inductor's saved pieces hold kernel *source*; loading one compiles it again, and even finding an
already-built `.so` in Inductor's cache asks g++ for its version and ISA first (TORCH_NOTES.md).
kiln sits at the one place Inductor turns C++ source into a loaded library
(`CppCodeCache.load_async`): while compiling it records which library each source built, and while
loading an artifact it hands back the shipped library for the same source, never calling a compiler.
"""

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path

import torch._inductor.utils
from torch._inductor.codecache import CppCodeCache

from kiln.errors import KilnError

_original_load_async = CppCodeCache.load_async.__func__


def content_key(cls: type, main_code: str, device_type: str, extra_flags, optimized_code: str | None) -> str:
    """Names a kernel by everything Inductor builds it from, except the machine's compiler flags
    (the manifest pins those through the system check)."""
    h = hashlib.sha256()
    for part in (cls.__name__, device_type, repr(tuple(extra_flags)), main_code, optimized_code or ""):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


@contextlib.contextmanager
def recording() -> Iterator[dict[str, Path]]:
    """Yield a dict that fills with content key -> built library path for every kernel Inductor
    loads inside the block. In-memory module caches are cleared first, so kernels this process built
    earlier are loaded (and recorded) again rather than silently reused."""
    built: dict[str, Path] = {}

    def load_async(cls, main_code, device_type="cpu", submit_fn=None, extra_flags=(), optimized_code=None, **kw):
        get = _original_load_async(
            cls, main_code, device_type, submit_fn=submit_fn, extra_flags=extra_flags, optimized_code=optimized_code, **kw
        )
        key = content_key(cls, main_code, device_type, extra_flags, optimized_code)

        def load():
            lib = get()
            built[key] = Path(getattr(lib, "__file__", None) or lib._name)
            return lib

        return load

    torch._inductor.utils.clear_caches()
    with _patched(load_async):
        yield built


@contextlib.contextmanager
def serving(kernel_dir: Path) -> Iterator[set[str]]:
    """Inside the block, Inductor gets every kernel from `kernel_dir/<content key>.so`; a kernel
    that is not there is an error, never a compile. Yields the set of keys served."""
    served: set[str] = set()

    def load_async(cls, main_code, device_type="cpu", submit_fn=None, extra_flags=(), optimized_code=None, **kw):
        key = content_key(cls, main_code, device_type, extra_flags, optimized_code)
        path = kernel_dir / f"{key}.so"
        if not path.is_file():
            raise KilnError(f"artifact lacks built kernel {key[:16]} ({path}): run `kiln compile` again")
        served.add(key)
        return lambda: cls._load_library(str(path), key)

    with _patched(load_async):
        yield served


@contextlib.contextmanager
def _patched(load_async) -> Iterator[None]:
    CppCodeCache.load_async = classmethod(load_async)
    try:
        yield
    finally:
        CppCodeCache.load_async = classmethod(_original_load_async)
