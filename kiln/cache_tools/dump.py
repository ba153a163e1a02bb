"""`kiln cache dump`: an artifact as files a person reads: the manifest, each variant's stitching
program, what the compile saw (Dynamo's decompiled bytecode and graph, the graphs before and after
the passes, every piece) and the C++ AOTInductor generated for each compiled piece."""

import json
import shutil
from pathlib import Path

from kiln.cache_tools.entries import Entry
from kiln.compiler import artifact
from kiln.errors import KilnError


def _blob_users(manifest: dict) -> dict[str, list[str]]:
    """sha256 -> "variant 0 submod_1 (dynamic)" for every piece and size that runs the blob, "LM head
    (panels16)" for the head's libraries, "library decode_attention" for the others."""
    users: dict[str, list[str]] = {}
    for i, variant in enumerate(manifest["variants"]):
        for name, piece in variant["pieces"].items():
            for size, blob in piece["sizes"].items():
                users.setdefault(blob["sha256"], []).append(f"variant {i} {name} ({size})")
    for format, blob in artifact.lm_head_libraries(manifest).items():
        users.setdefault(blob["sha256"], []).append(f"LM head ({format})")
    for name, blob in manifest.get("libraries", {}).items():
        users.setdefault(blob["sha256"], []).append(f"library {name}")
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
    for sha, users in _blob_users(entry.manifest).items():  # who runs each library's generated C++
        folder = out_dir / "debug" / "inductor" / sha[:16]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "USERS").write_text("".join(f"{user}\n" for user in users))
        written.append(folder / "USERS")
    return written
