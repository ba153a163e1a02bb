"""`kiln bench startup MODEL_DIR`: how long a fresh process takes to compile the model, and to reach
its first token from the artifact and eagerly.

Four modes, each run `repeats` times, every run a fresh Python process:

  cold_compile          `kiln compile` with an empty artifact cache, empty Inductor and piece caches and
                        a fresh TMPDIR (Inductor keeps its precompiled header there): nothing to reuse
  warm_compile          `kiln compile` again, the artifact present: it should only verify it
  artifact_first_token  start to first token of a process that loads the artifact (require_artifact)
  eager_first_token     the same on kiln's eager path: the baseline the artifact is held to

A sample is the wall time from starting the process to the moment its work is done (the compile
returned, or the first token came out), as the child reports it, so interpreter exit is not counted.
Every run gets its own empty Inductor cache and TMPDIR: a first-token run measures a server starting
on a machine that has the artifact and nothing else. Artifact and eager runs alternate, so load from
others on a shared machine falls on both alike.

Per mode the result holds every sample, the median and the spread as min and max: with the few
samples a compile-bound benchmark can afford, min and max show all there is, a stdev of three does not.

Each child also reports kiln's compiler counters (`kiln.compiler.counters`). The checks read counters
and one ratio, never absolute seconds, so they hold on slow and fast machines alike:

  cold_compile_compiles          every cold compile traced and compiled (else the cache was not cold)
  warm_compile_compiles_nothing  no warm compile traced or compiled anything
  artifact_load_compiles_nothing every artifact run loaded blobs and traced and compiled nothing
  artifact_over_eager            median artifact first token <= R x median eager (--max-artifact-ratio R)
"""

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.argtypes import at_least, positive
from kiln.config import DTYPES
from kiln.errors import KilnError

logger = logging.getLogger(__name__)

MODES: tuple[str, ...] = ("cold_compile", "warm_compile", "artifact_first_token", "eager_first_token")
LABELS: dict[str, str] = {
    "cold_compile": "cold compile",
    "warm_compile": "warm compile",
    "artifact_first_token": "artifact first token",
    "eager_first_token": "eager first token",
}
COMPILE_COUNTERS: tuple[str, ...] = ("graphs_traced", "pieces_compiled")
"""The counters that mean "the compiler did work": zero in every warm-compile and artifact run."""
PROMPT = "The kiln was"
CHILD_TIMEOUT_S = 3600
"""A child running longer than this is hung, not slow: the 16-layer cold compile takes minutes, not an hour."""

_MARK = "KILN_BENCH_STARTUP "  # prefixes the one stdout line a child reports on
_REPORT = f"""
from kiln.compiler.counters import counters
print({_MARK!r} + json.dumps({{"done": done, "counters": dict(counters)}}), flush=True)
"""
# The same code as `kiln compile`: the CLI's own entry point, so the counters are the real ones.
_COMPILE_CHILD = """
import json, sys, time
from kiln.cli import main
status = main(["compile", *sys.argv[1:]])
done = time.time()
""" + _REPORT + """
sys.exit(status)
"""
_FIRST_TOKEN_CHILD = """
import json, sys, time
from kiln import LLM, SamplingParams
model_dir, mode, cache_dir, dtype, prompt = sys.argv[1:]
artifact = mode == "artifact"
llm = LLM(model_dir, dtype=dtype, compile=artifact, cache_dir=cache_dir, require_artifact=artifact)
llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
done = time.time()
""" + _REPORT


@dataclass(frozen=True)
class Sample:
    """One fresh process: seconds from its start to its work done, and the compiler counters it ended with."""

    seconds: float
    counters: dict[str, int]


def _to_stderr(line: str) -> None:
    print(f"kiln bench startup: {line}", file=sys.stderr, flush=True)


def _child_env(root: Path) -> dict[str, str]:
    """An empty Inductor cache, piece cache and TMPDIR for one child, so it can reuse nothing an
    earlier one left."""
    (root / "tmp").mkdir(parents=True)
    return {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"), "TMPDIR": str(root / "tmp"),
            "KILN_PIECE_CACHE": str(root / "pieces")}


def _run_child(args: list[str], env: dict[str, str], label: str) -> Sample:
    cmd = [sys.executable, *args]
    logger.debug("running %s", cmd)
    start = time.time()  # wall clock: the child's `done` is read in another process
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise KilnError(f"{label} ran past {CHILD_TIMEOUT_S} s and was stopped: run the same step by hand with "
                        "`kiln -v` to see where it hangs") from None
    if proc.returncode != 0:
        raise KilnError(f"{label} failed (exit status {proc.returncode}); its stderr ends:\n{proc.stderr[-3000:]}")
    reports = [line for line in proc.stdout.splitlines() if line.startswith(_MARK)]
    if not reports:
        raise KilnError(f"{label} exited without reporting its timing (no {_MARK.strip()} line on stdout); "
                        f"its stdout ends:\n{proc.stdout[-2000:]}")
    report = json.loads(reports[-1][len(_MARK):])
    return Sample(report["done"] - start, {name: 0 for name in COMPILE_COUNTERS} | report["counters"])


def _artifact_in(cache: Path) -> Path:
    found = [p for p in cache.iterdir() if not p.name.startswith(".")]
    if len(found) != 1:
        raise KilnError(f"expected one artifact in the fresh cache {cache} after the cold compile, found {len(found)}")
    return found[0]


def cold_compile(model_dir: Path, work: Path, dtype: str = "float32") -> tuple[Sample, Path]:
    """One `kiln compile` in a fresh process with nothing to reuse (artifacts, Inductor's cache and
    TMPDIR all new, under `work`, which must not exist yet); returns its sample and the artifact it wrote."""
    cache = work / "artifacts"
    args = ["-c", _COMPILE_CHILD, str(model_dir), "--cache-dir", str(cache), "--dtype", dtype, "-q"]
    sample = _run_child(args, _child_env(work), "cold compile")
    return sample, _artifact_in(cache)


def warm_compile(model_dir: Path, cache: Path, work: Path, dtype: str = "float32") -> Sample:
    """`kiln compile` in a fresh process with the artifact already in `cache`."""
    args = ["-c", _COMPILE_CHILD, str(model_dir), "--cache-dir", str(cache), "--dtype", dtype, "-q"]
    return _run_child(args, _child_env(work), "warm compile")


def first_token(model_dir: Path, mode: str, cache: Path, work: Path, dtype: str = "float32") -> Sample:
    """A fresh process from start to its first generated token; `mode` "artifact" loads the artifact in
    `cache` (and fails if it is absent), "eager" runs kiln's eager path."""
    if mode not in ("artifact", "eager"):
        raise ValueError(f"mode must be 'artifact' or 'eager', got {mode!r}")
    args = ["-c", _FIRST_TOKEN_CHILD, str(model_dir), mode, str(cache), dtype, PROMPT]
    return _run_child(args, _child_env(work), f"{mode} first token")


def artifact_size(path: Path) -> dict[str, int]:
    """The artifact's unique compiled pieces (blobs) and its bytes on disk: what a load reads."""
    files = [p for p in path.rglob("*") if p.is_file()]
    return {"blobs": len(list((path / "blobs").glob("*.so"))), "bytes": sum(p.stat().st_size for p in files)}


def summarize(samples: list[Sample]) -> dict[str, Any]:
    """One mode's figures: every sample (seconds, and counters in the same order), median, min and max."""
    if not samples:
        raise ValueError("no samples to summarize")
    seconds = [s.seconds for s in samples]
    return {
        "samples_s": [round(s, 3) for s in seconds],
        "median_s": round(statistics.median(seconds), 3),
        "min_s": round(min(seconds), 3),
        "max_s": round(max(seconds), 3),
        "counters": [s.counters for s in samples],
    }


def machine() -> dict[str, Any]:
    """What the seconds depend on, so two results can be compared only where it is the same."""
    import torch

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}


def _brief(counters: dict[str, int]) -> str:
    done = [f"{name} {n}" for name, n in sorted(counters.items()) if n]
    return ", ".join(done) if done else "no compiler work"


def measure(model_dir: Path, repeats: int, dtype: str = "float32",
            report: Callable[[str], None] = _to_stderr, cold_repeats: int | None = None) -> dict[str, Any]:
    """Run every mode `repeats` times (cold compiles first, `cold_repeats` of them if given, then warm
    compiles, then artifact and eager first tokens alternating) in temporary directories it removes;
    `report` gets one line per run."""
    model_dir = Path(model_dir).resolve()
    samples: dict[str, list[Sample]] = {mode: [] for mode in MODES}

    cold_repeats = cold_repeats or repeats

    def record(mode: str, i: int, sample: Sample) -> None:
        samples[mode].append(sample)
        n = cold_repeats if mode == "cold_compile" else repeats
        report(f"{LABELS[mode]} {i + 1}/{n}: {sample.seconds:.1f} s ({_brief(sample.counters)})")

    with tempfile.TemporaryDirectory(prefix="kiln-bench-startup-") as tmp:
        work = Path(tmp)
        logger.info("benchmarking %s in %s", model_dir, work)
        artifact = None
        for i in range(cold_repeats):
            sample, artifact = cold_compile(model_dir, work / f"cold-{i}", dtype)
            record("cold_compile", i, sample)
        assert artifact is not None  # repeats >= 1
        cache = artifact.parent  # the last cold compile's: warm and artifact runs read it
        for i in range(repeats):
            record("warm_compile", i, warm_compile(model_dir, cache, work / f"warm-{i}", dtype))
        for i in range(repeats):
            for mode in ("artifact", "eager"):
                sample = first_token(model_dir, mode, cache, work / f"{mode}-{i}", dtype)
                record(f"{mode}_first_token", i, sample)
        size = artifact_size(artifact)
        size["keys_in_cache"] = len([p for p in cache.iterdir() if not p.name.startswith(".")])
    modes = {mode: summarize(s) for mode, s in samples.items()}
    return {
        "benchmark": "kiln bench startup",
        "model": str(model_dir),
        "dtype": dtype,
        "repetitions": repeats,
        "cold_repetitions": cold_repeats,
        "machine": machine(),
        "artifact": size,
        "modes": modes,
        "artifact_over_eager": round(modes["artifact_first_token"]["median_s"]
                                     / modes["eager_first_token"]["median_s"], 3),
    }


def _compiled(counters: dict[str, int]) -> str:
    return ", ".join(f"{name} {counters.get(name, 0)}" for name in COMPILE_COUNTERS)


def check(result: dict[str, Any], max_artifact_ratio: float | None) -> dict[str, dict[str, Any]]:
    """Each check's verdict ("passed": True, False, or None when not asked for) and a sentence with
    the figures behind it. Counters and a ratio only: seconds alone vary too much between machines."""
    modes, checks = result["modes"], {}

    def runs(mode: str, bad: Callable[[dict[str, int]], bool]) -> list[str]:
        return [f"run {i + 1} ({_compiled(c)}, blobs_loaded {c.get('blobs_loaded', 0)})"
                for i, c in enumerate(modes[mode]["counters"]) if bad(c)]

    idle = runs("cold_compile", lambda c: not all(c.get(name, 0) > 0 for name in COMPILE_COUNTERS))
    checks["cold_compile_compiles"] = {
        "passed": not idle,
        "detail": f"cold compile {', '.join(idle)} did not trace and compile: it reused something, so it was "
                  "not cold" if idle else "every cold compile traced and compiled",
    }
    busy = runs("warm_compile", lambda c: any(c.get(name, 0) for name in COMPILE_COUNTERS))
    keys = result["artifact"].get("keys_in_cache", 1)
    why = (f"; the cache holds {keys} artifact keys, so the key changed after the cold compile (kiln's "
           "sources, torch or the machine changed during the benchmark?)" if keys > 1 else "")
    checks["warm_compile_compiles_nothing"] = {
        "passed": not busy,
        "detail": f"warm compile {', '.join(busy)} compiled although the cold compile's artifact was present"
                  f"{why}" if busy else "no warm compile traced or compiled anything",
    }
    bad = runs("artifact_first_token",
               lambda c: any(c.get(name, 0) for name in COMPILE_COUNTERS) or not c.get("blobs_loaded", 0))
    checks["artifact_load_compiles_nothing"] = {
        "passed": not bad,
        "detail": f"artifact first token {', '.join(bad)}: a run from the artifact must load its blobs and "
                  "trace and compile nothing" if bad else "every artifact run loaded blobs and compiled nothing",
    }
    ratio = result["artifact_over_eager"]
    artifact_s, eager_s = modes["artifact_first_token"]["median_s"], modes["eager_first_token"]["median_s"]
    figures = f"median artifact first token {artifact_s:.2f} s is {ratio:.2f}x eager's {eager_s:.2f} s"
    if max_artifact_ratio is None:
        checks["artifact_over_eager"] = {"passed": None, "value": ratio, "limit": None,
                                         "detail": f"not checked (no --max-artifact-ratio): {figures}"}
    else:
        passed = ratio <= max_artifact_ratio
        checks["artifact_over_eager"] = {"passed": passed, "value": ratio, "limit": max_artifact_ratio,
                                         "detail": f"{figures} ({'within' if passed else 'over'} the limit "
                                                   f"{max_artifact_ratio:g}x)"}
    return checks


def failed(checks: dict[str, dict[str, Any]]) -> list[str]:
    """The checks that ran and failed, by name."""
    return [name for name, c in checks.items() if c["passed"] is False]


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise KilnError("--chart needs matplotlib, which is not installed: pip install matplotlib") from None


def write_chart(result: dict[str, Any], path: Path) -> None:
    """A PNG bar chart: each mode's median seconds, with min-max error bars. Drawn on an Agg canvas of
    its own, so it needs no display and leaves pyplot's global state alone."""
    _require_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    modes = result["modes"]
    names = [m for m in MODES if m in modes]
    medians = [modes[m]["median_s"] for m in names]
    below = [modes[m]["median_s"] - modes[m]["min_s"] for m in names]
    above = [modes[m]["max_s"] - modes[m]["median_s"] for m in names]
    fig = Figure(figsize=(8, 4.8))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    bars = ax.bar([LABELS[m].replace(" ", "\n", 1) for m in names], medians, yerr=[below, above], capsize=6,
                  color=["#b5563a", "#d9a066", "#3a7ab5", "#8c8c8c"][: len(names)])
    ax.bar_label(bars, labels=[f"{s:.2f} s" for s in medians], label_type="center", color="white",
                 fontweight="bold")
    ax.set_ylabel("seconds from process start")
    n = result["repetitions"]
    ax.set_title(f"kiln startup: {Path(result['model']).name} ({result['dtype']})\nmedian of {n} fresh "
                 f"process{'es' if n != 1 else ''} each, error bars min to max")
    ax.text(0.99, 0.97, f"artifact / eager first token: {result['artifact_over_eager']:.2f}x",
            transform=ax.transAxes, ha="right", va="top")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `kiln bench startup`, on the parser the CLI gives it."""
    parser.add_argument("model_dir", metavar="MODEL_DIR", help="Hugging Face model directory (config.json, "
                        "*.safetensors, tokenizer.json)")
    parser.add_argument("--repeats", type=at_least(1), default=3, metavar="N", help="fresh processes per mode "
                        "(default 3); the median counts, min and max show the spread")
    parser.add_argument("--cold-repeats", type=at_least(1), metavar="N", help="cold compiles (default: "
                        "--repeats); they take the longest and no check reads their time")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES], help="weights and "
                        "activations dtype (default auto: the checkpoint's)")
    parser.add_argument("--out", metavar="FILE.json", help="also write the JSON result here")
    parser.add_argument("--chart", metavar="FILE.png", help="also draw a bar chart of the medians here (needs "
                        "matplotlib)")
    parser.add_argument("--max-artifact-ratio", type=positive, metavar="R", help="exit 1 if the median artifact "
                        "first token exceeds R times the median eager one (CI: 1.5); the counter checks (cold "
                        "compile compiles, warm compile and artifact load compile nothing) always apply")


def run(args: argparse.Namespace) -> int:
    """Measure, print the JSON result on stdout (and write --out and --chart), then return the exit
    status: 1 if a check failed, each named on stderr with its figures, else 0. Unusable input or a
    failed run raises KilnError, as every kiln command does."""
    model_dir = Path(args.model_dir)
    if not (model_dir / "config.json").is_file():
        raise KilnError(f"{model_dir} is not a model directory (no config.json): pass a Hugging Face model "
                        "directory, e.g. one written by `kiln demo-model`")
    if args.chart:
        _require_matplotlib()  # now, not after minutes of measuring
    for option, out in (("--out", args.out), ("--chart", args.chart)):
        if out and not Path(out).resolve().parent.is_dir():
            raise KilnError(f"{option} {out}: directory {Path(out).resolve().parent} does not exist")
    result = measure(model_dir, args.repeats, args.dtype, cold_repeats=args.cold_repeats)
    result["checks"] = check(result, args.max_artifact_ratio)
    failures = failed(result["checks"])
    result["passed"] = not failures
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    if args.out:
        Path(args.out).write_text(text + "\n")
        _to_stderr(f"wrote {args.out}")
    if args.chart:
        write_chart(result, Path(args.chart))
        _to_stderr(f"wrote {args.chart}")
    for name in failures:
        _to_stderr(f"check {name} FAILED: {result['checks'][name]['detail']}")
    if not failures:
        _to_stderr(f"all checks passed ({', '.join(n for n, c in result['checks'].items() if c['passed'])})")
    return 1 if failures else 0
