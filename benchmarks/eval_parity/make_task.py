"""Rebuild kiln_mc.jsonl (shipped; run this only to change it): a multiple-choice task made from kiln's
demo corpus. Each item's context is the start of a corpus sentence and the right choice is the rest of
it; the three wrong choices end other sentences, so a model trained on the corpus beats chance."""

import json
import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    text = (ROOT / "kiln/models/demo_corpus.txt").read_text()
    sentences = [s.strip().replace("\n", " ") for s in re.split(r"(?<=[.!?])\s+", text) if len(s.split()) >= 10]
    items = [(" ".join(s.split()[:cut]), " " + " ".join(s.split()[cut:]))
             for s in sentences for cut in (len(s.split()) // 3, 2 * len(s.split()) // 3)]
    rnd = random.Random(0)
    lines = []
    for i, (context, right) in enumerate(items):
        choices = rnd.sample([r for j, (c, r) in enumerate(items) if j != i and r != right], 3) + [right]
        rnd.shuffle(choices)
        lines.append(json.dumps({"context": context, "choices": choices, "answer": choices.index(right)}))
    (Path(__file__).parent / "kiln_mc.jsonl").write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} items")


if __name__ == "__main__":
    main()
