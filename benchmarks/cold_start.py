"""Cold start: how long from a fresh process to the first generated token, compiled and eager, and
how compile time grows with depth.

For each model (the demo llama and a wider one) it runs `kiln bench startup`'s measurement
(kiln/bench/startup.py: cold compile, warm compile, artifact and eager first token, each in fresh
processes with empty caches, median and min-max of `--repeats`, compiler counters, checks), and, for
depth, compiles a 16-layer model of the demo's width cold: `depth_ratio` is its median compile time
over the 4-layer one's (goal <= 1.3), with both artifacts' unique blob counts.

    python benchmarks/cold_start.py [--out results.json] [--repeats 3] [--quick]

Prints one JSON object. `--quick` measures the demo model only, once.
"""

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness import emit  # noqa: E402  (benchmarks/ is the script's dir)

from kiln.bench import startup  # noqa: E402


def depth(shallow: dict, deep_dir: Path, work: Path, repeats: int) -> dict:
    """Cold compiles of the 16-layer model against the 4-layer `shallow` result."""
    runs = [startup.cold_compile(deep_dir, work / f"deep-{i}") for i in range(repeats)]
    deep_s = statistics.median(sample.seconds for sample, _ in runs)
    shallow_s = shallow["modes"]["cold_compile"]["median_s"]
    return {
        "layers_4_cold_compile_s": shallow_s,
        "layers_16_cold_compile_s": round(deep_s, 3),
        "depth_ratio": round(deep_s / shallow_s, 3),
        "layers_4_blobs": shallow["artifact"]["blobs"],
        "layers_16_blobs": startup.artifact_size(runs[-1][1])["blobs"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--quick", action="store_true", help="demo model only, one repeat")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per mode; the median counts")
    args = parser.parse_args()

    from kiln.models.demo import write_demo_model

    repeats = 1 if args.quick else args.repeats
    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as tmp:
        work = Path(tmp)
        models = {"demo": write_demo_model(work / "demo", num_layers=4, train_steps=0)}
        if not args.quick:
            models["wide"] = write_demo_model(work / "wide", num_layers=4, hidden_size=1024, train_steps=0)
        results: dict = {"machine": startup.machine(), "models": {}}
        for name, model_dir in models.items():
            result = startup.measure(model_dir, repeats)
            result["checks"] = startup.check(result, max_artifact_ratio=None)
            results["models"][name] = result
        if not args.quick:
            deep = write_demo_model(work / "deep", num_layers=16, train_steps=0)
            results["depth"] = depth(results["models"]["demo"], deep, work, repeats)
    emit(results, args.out)


if __name__ == "__main__":
    main()
