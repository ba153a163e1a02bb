"""Hugging Face transformers as the numeric oracle, and the shared test prompts."""

import torch


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """Hugging Face transformers as the oracle: greedy tokens and their logprobs, full recompute."""
    ids = list(prompt)
    logprobs = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            token = int(logits.argmax())
            logprobs.append(float(logits.log_softmax(-1)[token]))
            ids.append(token)
    return ids[len(prompt) :], logprobs


PROMPTS = [
    "The kiln was built at the edge of the village",
    "Why",
    "Loading the kiln is careful work. Large jars go to the back, where the heat is steady. Small cups",
    "Numbers matter in the workshop too.",
    "On the third morning",
    "A",
    "Cooling takes as long as heating, sometimes longer. Open the door too soon and the cold air will "
    "shatter the glaze. So the potters wait.",
    "Questions are welcome",
]
