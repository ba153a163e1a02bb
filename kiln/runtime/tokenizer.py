"""Text <-> token ids through Hugging Face `tokenizers` (tokenizer.json), the model's EOS ids,
incremental detokenization for streaming, and chat templates from tokenizer_config.json."""

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from kiln.errors import KilnError

FALLBACK_CHAT_TEMPLATE = (
    "{% if tools %}System: To call a function, answer with <tool_call>{\"name\": NAME, \"arguments\": "
    "ARGUMENTS}</tool_call> for each call. The functions:\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    "{% endif %}"
    "{% for message in messages %}{{ message['role'] | capitalize }}"
    "{% if message.name %} ({{ message.name }}){% endif %}: {{ message['content'] }}"
    "{% for call in message.tool_calls or [] %}<tool_call>"
    "{{ {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}</tool_call>{% endfor %}"
    "{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
"""For models whose tokenizer_config.json has no chat_template: "Role: content" lines ("Role (name):" with
a name), then "Assistant:"; tools and tool calls in the Hermes `<tool_call>` format that
`kiln.server.tool_calls` parses."""


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    """transformers' `tojson` for chat templates: plain JSON, where Jinja's own escapes HTML characters."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    """transformers' template global (Llama 3.1's template dates its system prompt)."""
    import datetime

    return datetime.datetime.now().strftime(format)


class TooManyTokens(KilnError):
    """A text longer than the caller's limit, in tokens: `count` of them, or at least `count` where
    `at_least` (a long text is refused from a prefix or its length, never tokenized whole)."""

    def __init__(self, count: int, limit: int, at_least: bool = False):
        self.count, self.at_least = count, at_least
        super().__init__(f"the text has {self.counted} tokens, more than the {limit} allowed")

    @property
    def counted(self) -> str:
        return f"at least {self.count}" if self.at_least else str(self.count)


EXACT_CHARS_PER_TOKEN = 8
"""Texts up to this many characters per allowed token are tokenized whole (an exact count in any
refusal); longer ones through growing prefixes, so the work is bounded by the limit, not the text."""

PREFIX_SLACK = 16
"""Tokens a prefix may have beyond the limit before it condemns the whole text: a cut can split a
word into more tokens than the whole text spends on it, never into this many more."""


def _ids(value) -> list[int]:
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise KilnError(
                f"{model_dir} has no tokenizer.json: kiln reads fast (tokenizers) tokenizers only; "
                "save one with transformers' AutoTokenizer.save_pretrained, or pass token ids"
            )
        self._tok = HFTokenizer.from_file(str(path))
        self.path = path
        f = model_dir / "tokenizer_config.json"
        self._config = json.loads(f.read_text()) if f.is_file() else {}
        self.eos_token_ids = self._eos_ids(model_dir)
        self.chat_template = self._chat_template(model_dir)
        self._render = None
        self._longest_token: int | None = None

    def _eos_ids(self, model_dir: Path) -> list[int]:
        """generation_config.json wins over config.json; tokenizer_config.json's eos_token is last."""
        for name in ("generation_config.json", "config.json"):
            f = model_dir / name
            if f.is_file():
                ids = _ids(json.loads(f.read_text()).get("eos_token_id"))
                if ids:
                    return ids
        eos = _token_text(self._config.get("eos_token"))
        if eos is not None and self._tok.token_to_id(eos) is not None:
            return [self._tok.token_to_id(eos)]
        return []

    def _chat_template(self, model_dir: Path) -> str:
        """chat_template.jinja (newer transformers) or tokenizer_config.json's chat_template (a string,
        or a list of named templates: "default"), else the fallback."""
        f = model_dir / "chat_template.jinja"
        if f.is_file():
            return f.read_text()
        template = self._config.get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) and template else FALLBACK_CHAT_TEMPLATE

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def longest_token(self) -> int:
        """The most characters one vocabulary entry spells: no token covers more of a text (byte-level
        entries spell one character per byte, and a text has no more characters than bytes)."""
        if self._longest_token is None:
            self._longest_token = max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1) or 1
        return self._longest_token

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """Token ids of `text`; `TooManyTokens` if there are more than `max_tokens`, with work bounded
        by `max_tokens` rather than the text: a text longer than `max_tokens` of the longest token is
        refused from its length, a long one from a prefix that already has too many tokens.
        Through `encode_batch_fast`, which releases the GIL (a long prompt never stalls the server's
        event loop) and skips the character offsets kiln does not use."""
        if max_tokens is None:
            return self._encode(text, add_special_tokens).ids
        if len(text) > max_tokens * self.longest_token:
            raise TooManyTokens(-(-len(text) // self.longest_token), max_tokens, at_least=True)
        size = max_tokens * EXACT_CHARS_PER_TOKEN + 1024
        while size < len(text):
            count = len(self._encode(text[:size], add_special_tokens))
            if count > max_tokens + PREFIX_SLACK:
                raise TooManyTokens(count - PREFIX_SLACK, max_tokens, at_least=True)
            size *= 2
        encoding = self._encode(text, add_special_tokens)
        if len(encoding) > max_tokens:
            raise TooManyTokens(len(encoding), max_tokens)
        return encoding.ids

    def _encode(self, text: str, add_special_tokens: bool):
        return self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]

    def token_string(self, token_id: int) -> str:
        """The vocabulary's string for one id (byte-level tokens as stored, e.g. "Ġthe")."""
        return self._tok.id_to_token(token_id) or ""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def special_token_id(self, text: str) -> int | None:
        """The id of the special token spelled `text` (Mistral's `[TOOL_CALLS]`), or None if there is none."""
        return next((i for i, t in self._tok.get_added_tokens_decoder().items() if t.special and t.content == text),
                    None)

    @property
    def renders_tools(self) -> bool:
        """Whether the chat template reads the `tools` it is given (else tool definitions would be dropped)."""
        return "tools" in self.chat_template

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, continue_final_message: bool = False,
                            template_kwargs: dict | None = None) -> str:
        """The prompt text for a chat, rendered like transformers does (sandboxed Jinja, its `tojson`
        and `strftime_now`); `tools` as JSON-schema function definitions, as transformers passes them.
        `continue_final_message`: the text ends inside the last message, which the model goes on writing;
        `template_kwargs`: more variables the template reads (Qwen3's `enable_thinking`)."""
        from jinja2 import TemplateError

        if self._render is None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(message: str):
                raise TemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals.update(raise_exception=raise_exception, strftime_now=_strftime_now)
            env.filters["tojson"] = _tojson
            self._render = env.from_string(self.chat_template).render
        if tools and not self.renders_tools:
            raise KilnError("this model's chat template does not render tools, so the model would never see "
                            "them: tool calling needs a template that does (Qwen2.5's, Hermes')")
        if continue_final_message and add_generation_prompt:
            raise KilnError("continue_final_message and add_generation_prompt cannot both be true: the prompt "
                            "would end after the final message, not inside it; set add_generation_prompt false")
        reserved = sorted(set(template_kwargs or ()) & TEMPLATE_VARIABLES)
        if reserved:
            raise KilnError(f"chat_template_kwargs: {', '.join(reserved)} come from the request itself, not "
                            "from chat_template_kwargs")
        specials = {k: _token_text(self._config.get(k)) or "" for k in ("bos_token", "eos_token")}
        try:
            text = self._render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools or None,
                                **specials, **(template_kwargs or {}))
        except TemplateError as e:
            raise KilnError(f"the chat template refused these messages: {e}") from None
        return _cut_after_final(text, messages[-1]) if continue_final_message else text


TEMPLATE_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})
"""What `apply_chat_template` itself gives a template, which template kwargs may not replace."""


def _cut_after_final(text: str, final: dict) -> str:
    """The rendered chat up to the end of its final message's text (what transformers does for
    `continue_final_message`): the template's end-of-turn after it is dropped."""
    content = final.get("content") or ""
    for wanted in (content, content.strip()):
        at = text.rfind(wanted) if wanted else -1
        if at >= 0:
            return text[:at + len(wanted)]
    raise KilnError("continue_final_message needs the final message's text in the rendered prompt: "
                    "give that message some content (the template dropped it, or it is empty)")


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas. Decodes a short window of recent tokens
    rather than all of them, and holds back a delta that ends in an incomplete UTF-8 character (a
    byte-level token may carry half of one), so a stream never shows a broken character."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self._tok, self._skip = tokenizer, skip_special_tokens
        self._ids = list(prompt_token_ids[-6:])  # context: a token's leading space depends on the one before
        self._prefix, self._read = max(len(self._ids) - 5, 0), len(self._ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is incomplete)."""
        self._ids.append(token_id)
        before = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        after = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta
