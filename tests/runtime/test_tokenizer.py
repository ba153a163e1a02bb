"""A bounded encode: a text over its token limit is refused after work bounded by the limit, never by
the text (a 4 MB prompt used to be tokenized whole before its 400)."""

import pytest

from kiln.errors import KilnError
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


THINKING_TEMPLATE = (  # Qwen3's way with enable_thinking, in short
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and enable_thinking is false %}"
    "<think></think>{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory) -> Tokenizer:
    root = tmp_path_factory.mktemp("chat")
    train_tokenizer().save(str(root / "tokenizer.json"))
    (root / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return Tokenizer(root)


def test_template_kwargs_reach_the_template_and_cannot_replace_its_own(chat_tok):
    chat = [{"role": "user", "content": "hi"}]
    assert chat_tok.apply_chat_template(chat) == "<|user|>hi<|end|><|assistant|>"
    assert chat_tok.apply_chat_template(chat, template_kwargs={"enable_thinking": False}).endswith(
        "<|assistant|><think></think>")
    with pytest.raises(KilnError, match="add_generation_prompt come from the request itself"):
        chat_tok.apply_chat_template(chat, template_kwargs={"add_generation_prompt": False})


def test_continue_final_message_ends_the_prompt_inside_it(chat_tok):
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Paris is "}]
    assert chat_tok.apply_chat_template(chat, add_generation_prompt=False, continue_final_message=True) == \
        "<|user|>hi<|end|><|assistant|>Paris is "
    assert chat_tok.apply_chat_template(chat, add_generation_prompt=False).endswith("Paris is <|end|>")
    with pytest.raises(KilnError, match="cannot both be true"):
        chat_tok.apply_chat_template(chat, continue_final_message=True)
    with pytest.raises(KilnError, match="needs the final message's text"):
        chat_tok.apply_chat_template([*chat, {"role": "assistant", "content": ""}], add_generation_prompt=False,
                                     continue_final_message=True)
