"""lm-evaluation-harness against `kiln serve` and against transformers, on one checkpoint: the same
accuracy, and the same loglikelihood for every (item, choice).

    python benchmarks/eval_parity.py [--model-dir DIR] [--out results.json] [--artifact auto|eager]

The task is multiple choice, defined here and shipped (`eval_parity/kiln_mc.jsonl`, 56 items made
from kiln's demo corpus; nothing is downloaded). lm-eval scores it twice: through its
`local-completions` model against a `kiln serve` started here (echo + logprobs, the way it scores
every loglikelihood task against an OpenAI-style server), and through its `hf` model (transformers,
fp32) on the same checkpoint. The model defaults to the demo model, built here.
Needs the bench extra (`pip install -e ".[bench]"`: lm_eval[api]).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
TASK = "kiln_mc"


def task_dir(root: Path) -> Path:
    """lm-eval's task config, pointing at the shipped items (lm-eval's `json` loader: local, no download)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {HERE / 'eval_parity' / 'kiln_mc.jsonl'}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n")
    return root


def evaluate(model: str, model_args: str, tasks: Path) -> tuple[float, list[list[float]]]:
    """(accuracy, per item the loglikelihood of each choice) from one lm-eval run."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], log_samples=True,
                                  task_manager=TaskManager(include_path=str(tasks)), batch_size=8)
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return out["results"][TASK]["acc,none"], [[float(r[0]) for r in s["filtered_resps"]] for s in samples]


def serve(model_dir: Path, artifact: str, cache: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "serve", str(model_dir), "--port", str(port),
                             "--artifact", artifact, "--cache-dir", str(cache), "--served-model-name", "demo"],
                            env={**os.environ, "PYTHONPATH": str(HERE.parent)})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"kiln serve exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise SystemExit("kiln serve did not become ready in 10 minutes")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", type=Path, help="a Hugging Face model directory (default: the demo model)")
    parser.add_argument("--artifact", default="auto", help="kiln serve's --artifact: auto (compiled) or eager")
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE.parent))
    from kiln.models.demo import write_demo_model

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = args.model_dir or write_demo_model(tmp / "demo")
        tasks = task_dir(tmp / "tasks")
        proc, base = serve(model_dir, args.artifact, tmp / "cache")
        try:
            kiln_acc, kiln_ll = evaluate("local-completions", f"model=demo,base_url={base}/v1/completions,"
                                         f"tokenizer_backend=huggingface,tokenizer={model_dir},num_concurrent=1,"
                                         "max_retries=1", tasks)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        hf_acc, hf_ll = evaluate("hf", f"pretrained={model_dir},dtype=float32,device=cpu", tasks)
    diffs = [abs(a - b) for ka, ha in zip(kiln_ll, hf_ll) for a, b in zip(ka, ha)]
    picks = sum(max(range(len(k)), key=k.__getitem__) != max(range(len(h)), key=h.__getitem__)
                for k, h in zip(kiln_ll, hf_ll))
    results = {"task": TASK, "items": len(kiln_ll), "accuracy": {"kiln_serve": kiln_acc, "hf": hf_acc},
               "loglikelihood_max_abs_diff": max(diffs), "loglikelihood_mean_abs_diff": sum(diffs) / len(diffs),
               "items_whose_pick_differs": picks, "artifact": args.artifact}
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
