"""`kiln cache dump`: an artifact as files a person reads: the manifest, each variant's stitching
program, what the compile saw (Dynamo's decompiled bytecode and graph, the graphs before and after
the passes, every piece) and the code Inductor generated for each compiled piece."""

import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path

from kiln.cache_tools.entries import Entry
from kiln.compiler import artifact
from kiln.errors import KilnError


def inductor_source(blob: Path) -> str:
    """The Python (with its C++ kernels inline) that Inductor generated for one saved piece, read
    from the blob without loading or compiling it. Uses torch internals: a newer torch may move them."""
    import torch
    from torch._inductor.codecache import FxGraphCache
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    from torch.utils._appending_byte_serializer import BytesReader

    reader = BytesReader(blob.read_bytes())
    reader.read_bytes()  # header
    reader.read_bytes()  # torch build
    reader.read_str()  # AOTAutograd cache key
    entries = reader.read_bytes()
    sources = []
    with tempfile.TemporaryDirectory(prefix="kiln-dump-") as tmp, temporary_cache_dir(tmp):
        info = torch.compiler.load_cache_artifacts(entries)
        for key in info.inductor_artifacts if info is not None else ():
            folder = FxGraphCache._get_tmp_dir_for_key(key)
            for name in sorted(os.listdir(folder)):
                with open(os.path.join(folder, name), "rb") as f:
                    sources.append(pickle.load(f).source_code)
    if not sources:
        raise ValueError("the blob holds no Inductor graph")
    return "\n".join(sources)


def _blob_users(manifest: dict) -> dict[str, list[str]]:
    """sha256 -> "variant 0 submod_1 (dynamic)" for every piece and size that runs the blob."""
    users: dict[str, list[str]] = {}
    for i, variant in enumerate(manifest["variants"]):
        for name, piece in variant["pieces"].items():
            for size, blob in piece["sizes"].items():
                users.setdefault(blob["sha256"], []).append(f"variant {i} {name} ({size})")
    return users


def dump_entry(entry: Entry, out_dir: Path) -> list[Path]:
    """Write `entry` as readable files under `out_dir` (created; must be empty if it exists)."""
    if entry.manifest is None:
        raise KilnError(f"cannot dump {entry.key}: {entry.error}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise KilnError(f"{out_dir} is not empty: name a new directory with -o")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / artifact.MANIFEST]
    written[0].write_text(json.dumps(entry.manifest, indent=1, sort_keys=True) + "\n")
    for folder in (artifact.PROGRAMS, "debug"):
        if (entry.path / folder).is_dir():
            shutil.copytree(entry.path / folder, out_dir / folder)
            written += sorted(p for p in (out_dir / folder).rglob("*") if p.is_file())
    (out_dir / "inductor").mkdir()
    for sha, users in _blob_users(entry.manifest).items():
        target = out_dir / "inductor" / f"{sha[:16]}.py"
        header = "".join(f"# runs {user}\n" for user in users)
        try:
            body = inductor_source(entry.path / "blobs" / sha)
        except Exception as e:  # a missing or damaged blob, or a torch whose internals moved
            body = f"# could not read the generated code: {type(e).__name__}: {e}\n"
        target.write_text(header + body)
        written.append(target)
    return written
