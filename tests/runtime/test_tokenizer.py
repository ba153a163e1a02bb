"""A bounded encode: a text over its token limit is refused after work bounded by the limit, never by
the text (a 4 MB prompt used to be tokenized whole before its 400)."""

import pytest

from kiln.models.demo import train_tokenizer
from kiln.runtime.tokenizer import EXACT_CHARS_PER_TOKEN, Tokenizer, TooManyTokens


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    root = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer().save(str(root / "tokenizer.json"))
    tokenizer = Tokenizer(root)
    tokenizer.encoded = []
    plain = tokenizer._encode

    def recorded(text, special):
        tokenizer.encoded.append(len(text))
        return plain(text, special)

    tokenizer._encode = recorded
    return tokenizer


def test_texts_within_the_limit_get_their_exact_ids(tok):
    for text in ("kiln fire " * 40, "a b " * 100, "xy"):
        whole = tok.encode(text)
        assert tok.encode(text, max_tokens=len(whole)) == whole
        with pytest.raises(TooManyTokens) as e:
            tok.encode(text, max_tokens=len(whole) - 1)
        assert e.value.count == len(whole) and not e.value.at_least


def test_a_text_longer_than_the_limit_allows_is_refused_unread(tok):
    assert tok.longest_token == 13  # "<|endoftext|>"
    tok.encoded.clear()
    with pytest.raises(TooManyTokens) as e:
        tok.encode("a b " * 1_000_000, max_tokens=255)
    assert e.value.at_least and e.value.count == 4_000_000 // 13 + 1
    assert "at least" in str(e.value)
    assert tok.encoded == []


def test_a_long_text_is_refused_from_a_prefix(tok):
    limit = 300
    text = "a b " * 900  # 1800 tokens in 3600 characters: under limit x longest token, over the exact size
    exact = limit * EXACT_CHARS_PER_TOKEN + 1024
    assert exact < len(text) <= limit * tok.longest_token
    tok.encoded.clear()
    with pytest.raises(TooManyTokens) as e:
        tok.encode(text, max_tokens=limit)
    assert tok.encoded == [exact]
    assert e.value.at_least and limit < e.value.count <= len(tok.encode(text))
