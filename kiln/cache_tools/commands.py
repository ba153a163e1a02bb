"""What each `kiln cache` subcommand prints: a table for people, or `--json` for machines. Each
returns the process exit status."""

import json
import time
from pathlib import Path

from tabulate import tabulate

from kiln.cache_tools import dump, explain, prune, transfer
from kiln.cache_tools.entries import Entry, find_entry, list_entries
from kiln.units import format_size
from kiln.cache_tools.verify import verify_entry
from kiln.compiler import artifact


def _when(t: float | None) -> str:
    return "never" if t is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _print_json(value: object) -> None:
    print(json.dumps(value, indent=1, default=str))


def _model(entry: Entry) -> str:
    if entry.manifest is None:
        return "?"
    name = entry.manifest.get("model_name") or "-"
    return f"{name} ({entry.factor('model', 'architecture', default='?')}, {entry.factor('model', 'num_layers')}L)"


def _isa(entry: Entry) -> str:
    return str(entry.factor("system", "gpu_arch") or entry.factor("system", "cpu_capability", default="?"))


def _summary(entry: Entry) -> dict:
    return {
        "key": entry.key,
        "path": str(entry.path),
        "model": entry.manifest.get("model_name") if entry.manifest else None,
        "architecture": entry.factor("model", "architecture"),
        "dtype": entry.factor("dtype"),
        "quantization": entry.factor("quantization"),
        "bytes": entry.bytes,
        "created": entry.created,
        "last_used": entry.last_used,
        "torch": entry.factor("torch"),
        "isa": _isa(entry) if entry.manifest else None,
        "error": entry.error,
    }


def ls(cache_dir: Path, as_json: bool) -> int:
    entries = list_entries(cache_dir)
    if as_json:
        _print_json([_summary(e) for e in entries])
        return 0
    if not entries:
        print(f"no artifacts in {cache_dir}")
        return 0
    rows = [[e.key[:12], _model(e), e.factor("dtype", default="?"), e.factor("quantization") or "-",
             format_size(e.bytes), _when(e.created), _when(e.last_used), e.factor("torch", default="?"), _isa(e)]
            if e.manifest else [e.key[:12], f"unreadable: {e.error}", "", "", format_size(e.bytes), _when(e.created),
                                _when(e.last_used), "", ""]
            for e in entries]
    print(tabulate(rows, ["KEY", "MODEL", "DTYPE", "QUANT", "SIZE", "CREATED", "LAST USED", "TORCH", "ISA"],
                   tablefmt="plain"))
    print(f"\n{len(entries)} artifact{'s' * (len(entries) != 1)}, {format_size(sum(e.bytes for e in entries))} in {cache_dir}")
    return 0


def _folder_bytes(entry: Entry, folder: str) -> tuple[int, int]:
    files = [p for p in (entry.path / folder).rglob("*") if p.is_file()] if (entry.path / folder).is_dir() else []
    return len(files), sum(p.stat().st_size for p in files)


def _lm_head(head: dict) -> str:
    """How the LM head runs: its weight's format, the greedy screen's int8 GEMM, the libraries shipped."""
    text = f"packed as {head['format']}" if head.get("format") else "on the weight as loaded"
    if head.get("screen"):
        text += f", greedy screen on {head['screen']}"
    libraries = artifact.lm_head_libraries({"lm_head": head})
    if libraries:
        text += ", libraries " + ", ".join(f"{f} {e['sha256'][:16]} ({format_size(e['bytes'])})"
                                          for f, e in libraries.items())
    return text


def info(cache_dir: Path, key: str, as_json: bool) -> int:
    entry = find_entry(cache_dir, key)
    if entry.manifest is None:
        raise artifact.ArtifactError(entry.error or "unreadable manifest")
    m = entry.manifest
    if as_json:
        _print_json({**_summary(entry), "manifest": m})
        return 0
    f = m["factors"]
    model = f["model"]
    print(tabulate([
        ["key", entry.key],
        ["path", entry.path],
        ["model", f"{_model(entry)}, hidden {model['hidden_size']}, {model['num_heads']} heads "
                  f"({model['num_kv_heads']} kv), vocab {model['vocab_size']}"],
        ["dtype", f"{f['dtype']}, quantization {f['quantization'] or 'none'}"],
        *([["GGUF types", ", ".join(f"{n} {kind}" for kind, n in m["weight_types"].items())
            + " (the file it was compiled for)"]] if m.get("weight_types") else []),
        ["compile", ", ".join(f"{k} {v}" for k, v in f["compile"].items() if k != "passes")],
        ["built", f"{_when(entry.created)} with kiln {m['kiln']}, torch {f['torch']}, Python {f['python']} on "
                  f"{f['system']['machine']} {_isa(entry)}"],
        ["last used", _when(entry.last_used)],
        ["size", f"{format_size(entry.bytes)}: " + ", ".join(
            f"{n} {folder} ({format_size(b)})" for folder in ("blobs", "programs", "kernels", "debug")
            for n, b in [_folder_bytes(entry, folder)] if n)],
        *([["triton kernels", f"{len({rel.split('/')[0] for rel in m['triton_kernels']['files']})} built by triton "
                              f"{m['triton_kernels']['triton']} (installed into Triton's cache at load)"]]
          if m.get("triton_kernels") else []),
        *([["LM head", _lm_head(m["lm_head"])]] if m.get("lm_head") else []),
        *([["libraries", ", ".join(f"{name} {e['sha256'][:16]} ({format_size(e['bytes'])})"
                                   for name, e in m["libraries"].items())]] if m.get("libraries") else []),
    ], tablefmt="plain"))
    for i, variant in enumerate(m["variants"]):
        label = artifact.variant_label(variant["ranges"], variant["sizes"])
        print(f"\nvariant {i}: tokens {label}, program {artifact.PROGRAMS}/{i}.py")
        rows = [[name, size, blob["sha256"][:16], format_size(blob["bytes"])]
                for name, piece in variant["pieces"].items() for size, blob in piece["sizes"].items()]
        print(tabulate(rows, ["piece", "size", "blob", "bytes"], tablefmt="plain"))
        print()
        print(tabulate([[p["name"], "-" if p["matches"] is None else p["matches"], f"{p['seconds']:.3f}"]
                        for p in variant["passes"]], ["pass", "matches", "seconds"], tablefmt="plain"))
    print()
    order = ["trace", "passes", "split", "compile", "save", "triton_kernels"]
    timings = dict(sorted(m.get("timings", {}).items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else 9))
    print(tabulate([[k, f"{v:.2f}"] for k, v in timings.items()] + [["total", f"{sum(timings.values()):.2f}"]],
                   ["stage", "seconds"], tablefmt="plain"))
    return 0


def verify(cache_dir: Path, keys: list[str], as_json: bool) -> int:
    """Exit status 1 if any artifact is corrupt; an intact artifact built for another machine is
    reported but is not corruption."""
    entries = [find_entry(cache_dir, k) for k in keys] if keys else list_entries(cache_dir)
    verdicts = [verify_entry(e) for e in entries]
    if as_json:
        _print_json([{"key": v.key, "ok": v.ok, "files": v.files, "problems": v.problems,
                      "incompatible": v.incompatible} for v in verdicts])
    else:
        for v in verdicts:
            if not v.ok:
                print(f"CORRUPT {v.key}")
                for problem in v.problems:
                    print(f"  {problem}")
            else:
                print(f"ok      {v.key} ({v.files} files)"
                      + (f"\n  intact, but will not load here: {v.incompatible}" if v.incompatible else ""))
        if not verdicts:
            print(f"no artifacts in {cache_dir}")
    return 1 if any(not v.ok for v in verdicts) else 0


def _print_differences(diffs: list[explain.Difference], labels: tuple[str, str], as_json: bool, head: dict) -> None:
    if as_json:
        _print_json({**head, "differences": [
            {"factor": d.factor, labels[0]: None if d.a is explain.ABSENT else d.a,
             labels[1]: None if d.b is explain.ABSENT else d.b, "meaning": d.meaning} for d in diffs]})
        return
    if not diffs:
        print("the key factors are the same")
        return
    print(tabulate([[d.factor, explain.show(d.a), explain.show(d.b), d.meaning] for d in diffs],
                   ["factor", *labels, "meaning"], tablefmt="plain"))


def explain_keys(cache_dir: Path, key_a: str, key_b: str, as_json: bool) -> int:
    a, b = find_entry(cache_dir, key_a), find_entry(cache_dir, key_b)
    for e in (a, b):
        if e.manifest is None:
            raise artifact.ArtifactError(e.error or "unreadable manifest")
    labels = (a.key[:12], b.key[:12])
    diffs = explain.differences(a.manifest["factors"], b.manifest["factors"], labels)
    _print_differences(diffs, labels, as_json, {"a": a.key, "b": b.key})
    return 0


def explain_model(cache_dir: Path, factors: dict, key: str, model_dir: str, as_json: bool) -> int:
    """Why `model_dir` (whose factors and key are given) misses the cache: the differences from the
    nearest artifact there."""
    entries = {e.key: e.manifest["factors"] for e in list_entries(cache_dir) if e.manifest}
    if key in entries:
        print(json.dumps({"key": key, "hit": True}) if as_json else f"{key} is in the cache: {model_dir} hits it")
        return 0
    nearest = explain.nearest(factors, entries)
    if nearest is None:
        print(json.dumps({"key": key, "hit": False, "nearest": None}) if as_json else
              f"{key} is not in {cache_dir}, which holds no artifacts")
        return 0
    if not as_json:
        print(f"{key} is not in the cache; the nearest artifact is {nearest}:\n")
    labels = ("this model", nearest[:12])
    _print_differences(explain.differences(factors, entries[nearest], labels), labels, as_json,
                       {"key": key, "hit": False, "nearest": nearest})
    return 0


def prune_cache(cache_dir: Path, older_than: float | None, max_size: int | None, dry_run: bool, as_json: bool) -> int:
    report = prune.prune(cache_dir, older_than, max_size, dry_run)
    if as_json:
        _print_json({"removed": [e.key for e in report.removed], "freed_bytes": report.freed_bytes,
                     "busy": {e.key: why for e, why in report.busy}, "kept": [e.key for e in report.kept],
                     "pieces_removed": report.pieces_removed, "packed_removed": report.packed_removed,
                     "dry_run": dry_run})
        return 0
    verb = "would remove" if dry_run else "removed"
    for e in report.removed:
        print(f"{verb} {e.key} {_model(e)} {format_size(e.bytes)}, last used {_when(e.last_used)}")
    for e, why in report.busy:
        print(f"kept    {e.key}: {why}")
    pieces = f" and {report.pieces_removed} compiled pieces" if report.pieces_removed else ""
    pieces += f" and {report.packed_removed} files of packed weights" if report.packed_removed else ""
    print(f"{verb} {len(report.removed)} artifacts{pieces} ({format_size(report.freed_bytes)}); "
          f"{len(report.kept)} kept")
    return 0


def export(cache_dir: Path, key: str, out: Path, as_json: bool, sha256: bool = False) -> int:
    entry = find_entry(cache_dir, key)
    path = transfer.export_entry(entry, out)
    size = path.stat().st_size
    digest = transfer.write_digest(path) if sha256 else None
    print(json.dumps({"key": entry.key, "path": str(path), "bytes": size,
                      **({"sha256_file": str(digest)} if digest else {})}) if as_json else
          f"exported {entry.key} to {path} ({format_size(size)})" + (f"; its sha256 is in {digest}" if digest else ""))
    return 0


def import_(cache_dir: Path, tarball: Path, as_json: bool, sha256: str | None = None,
            max_size: int | None = None) -> int:
    entry, new = transfer.import_tarball(cache_dir, tarball, sha256, max_size)
    print(json.dumps({"key": entry.key, "path": str(entry.path), "new": new}) if as_json else
          f"{'imported' if new else 'already present:'} {entry.key} ({_model(entry)}) into {entry.path.parent}")
    return 0


def dump_artifact(cache_dir: Path, key: str, out: Path | None, as_json: bool) -> int:
    entry = find_entry(cache_dir, key)
    out = Path(out or f"kiln-dump-{entry.key[:12]}")
    written = dump.dump_entry(entry, out)
    if as_json:
        _print_json({"key": entry.key, "out": str(out), "files": [str(p) for p in written]})
    else:
        print(f"wrote {len(written)} files for {entry.key} to {out}/: manifest.json, programs/ (stitching code), "
              "debug/dynamo/ (decompiled bytecode, Dynamo graph), debug/graphs*/ (before and after passes, each "
              "piece), debug/inductor/ (generated C++ per compiled piece)")
    return 0
