import json

import pytest
import torch

from kiln import KilnError
from kiln.runtime.structured_output import GrammarBackend, StructuredOutput, apply_masks, fill_masks


def test_apply_masks_matches_the_bits():
    """Bit t of word t // 32 allows token t; rows not listed are untouched; logits past the mask's
    width (a model vocabulary padded beyond the tokenizer's) are never allowed."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 100, generator=generator)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 3), dtype=torch.int32, generator=generator)  # 96 tokens
    want = logits.clone()
    for row, bits in zip((1, 3), bitmask):
        for t in range(100):
            if t >= 96 or not (int(bits[t // 32]) >> (t % 32)) & 1:
                want[row, t] = float("-inf")
    apply_masks(logits, [1, 3], bitmask)
    assert torch.equal(logits, want)


def test_grammar_masks_follow_the_tokens(demo_dirs):
    from kiln.runtime.tokenizer import Tokenizer

    tok = Tokenizer(demo_dirs["llama"])
    backend = GrammarBackend(tok.path, tok.vocab_size + 7, tok.eos_token_ids)
    matcher = backend.matcher(StructuredOutput("choice", ("red clay", "blue glaze")))
    ids = tok.encode("blue glaze", add_special_tokens=False)
    for token in ids:
        [bits], [error] = fill_masks([matcher], backend.vocab_size)
        assert error is None
        allowed = {t for t in range(backend.vocab_size) if (int(bits[t // 32]) >> (t % 32)) & 1}
        assert token in allowed and allowed <= set(range(tok.vocab_size))
        assert tok.encode("x", add_special_tokens=False)[0] not in allowed
        assert matcher.accept(token)
    [bits], _ = fill_masks([matcher], backend.vocab_size)
    allowed = {t for t in range(backend.vocab_size) if (int(bits[t // 32]) >> (t % 32)) & 1}
    assert allowed == set(tok.eos_token_ids)  # complete: only the end remains
    with pytest.raises(KilnError, match="invalid json for structured output"):
        backend.validate(StructuredOutput.json_schema(json.dumps({"type": 5})))
