"""From an API request to engine requests and back: the body parsed, limits, tokenization, the engine
streams, and each choice's JSON (whole, or as server-sent events).

What grows with the request (tokenizing, compiling its grammar, formatting a long answer with its
logprobs) runs on worker threads, never on the event loop: one large request does not stall health
checks or other clients.
"""

import asyncio
import base64
import itertools
import logging
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool

from kiln.config import ServerConfig
from kiln.errors import KilnError
from kiln.runtime.async_engine import AsyncEngine, RequestStream
from kiln.runtime.engine import RequestOutput
from kiln.runtime.sampler import SamplingParams
from kiln.runtime.structured_output import StructuredOutput
from kiln.runtime.tokenizer import Tokenizer, TooManyTokens
from kiln.server import reasoning, tool_calls
from kiln.server.errors import ServerError, stream_error
from kiln.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                                  NamedToolChoice, SamplingRequest, StreamOptions, TokenizeRequest, to_json,
                                  validation_message)

logger = logging.getLogger(__name__)
Body = TypeVar("Body", bound=BaseModel)

Prompt = tuple[list[int], str | None]
"""A prompt's token ids, and its text where it came as text."""


class Server:
    """Turns API requests into engine requests and engine outputs into API responses."""

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, model_name: str, max_model_len: int,
                 config: ServerConfig | None = None, vocab_size: int | None = None):
        self.engine, self.tokenizer = engine, tokenizer
        self.vocab_size = vocab_size or tokenizer.vocab_size
        """The model's vocabulary, which token ids must fall in (the tokenizer's may be smaller)."""
        self.model_name, self.max_model_len = model_name, max_model_len
        self.config = config or ServerConfig()
        self.tool_format = tool_calls.tool_format(self.config.tool_call_parser, tokenizer)
        self.created = int(time.time())

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ServerError(404, f"the model `{name}` does not exist; this server serves `{self.model_name}`",
                              param="model")

    def max_tokens(self, prompt_len: int, asked: int | None) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ServerError(400, f"the prompt has {prompt_len} tokens; this model's context is "
                                   f"{self.max_model_len} tokens, which leaves no room to generate")
        if asked is not None and asked > room:
            raise ServerError(400, f"max_tokens {asked} + the prompt's {prompt_len} tokens exceed the model's "
                                   f"context of {self.max_model_len} tokens")
        return asked if asked is not None else room

    def check_limits(self, body: SamplingRequest) -> None:
        """The caps on what a request makes every step do: each a 400 naming the cap and its flag."""
        c = self.config
        _cap("logit_bias entries", len(body.logit_bias or {}), c.max_logit_bias, "--max-logit-bias")
        stop = body.stop_strings
        _cap("stop strings", len(stop), c.max_stop_strings, "--max-stop-strings")
        _cap("characters in a stop string", max(map(len, stop), default=0), c.max_stop_length, "--max-stop-length")
        for choices in (body.guided_choice, body.structured_outputs and body.structured_outputs.choice):
            _cap("choices", len(choices or ()), c.max_choices, "--max-choices")

    def constraint(self, body: SamplingRequest) -> StructuredOutput | None:
        """The request's output constraint (the tool calls' among them), within the size
        cap (llguidance's compile time grows faster than the grammar)."""
        found = body.structured_output()
        if isinstance(body, ChatCompletionRequest) and body.tools and body.tool_mode != "none":
            found = self.tool_format.constraint(body.tools, body.tool_mode, body.parallel_tool_calls, found) or found
        if found is not None:
            size = sum(len(s.encode()) for s in found.spec) if found.kind == "choice" else len(found.spec.encode())
            _cap(f"bytes of {found.kind} constraint", size, self.config.max_grammar_bytes, "--max-grammar-bytes")
        return found

    def with_tool_marker(self, body: ChatCompletionRequest) -> ChatCompletionRequest:
        """`body`, its answers detokenized with special tokens where it has tools and the tool-call format's
        marker is a special token (vLLM's rule): the parser must see the marker."""
        if body.tools and body.tool_mode != "none" and self.tool_format.keeps_special_tokens:
            return body.model_copy(update={"skip_special_tokens": False})
        return body

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s token ids; a 400 as soon as it is known not to fit the context."""
        try:
            return self.tokenizer.encode(text, add_special_tokens, max_tokens=self.max_model_len - 1)
        except TooManyTokens as e:
            raise ServerError(400, f"the prompt has {e.counted} tokens; this model's context is "
                                   f"{self.max_model_len} tokens, which leaves no room to generate") from None

    def completion_prompts(self, prompt) -> list[Prompt]:
        """A string, a list of strings, a list of token ids, or a list of those -> [(ids, text or None)]."""
        if isinstance(prompt, str):
            return [(self.encode(prompt), prompt)]
        if not prompt:
            raise KilnError("the prompt is empty: give text or at least one token id")
        if isinstance(prompt[0], int):
            return [(list(prompt), None)]
        if isinstance(prompt[0], str):
            return [(self.encode(p), p) for p in prompt]
        return [(list(p), None) for p in prompt]

    def chat_prompt(self, body: ChatCompletionRequest) -> Prompt:
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        text = self.tokenizer.apply_chat_template([m.for_template() for m in body.messages], tools=tools,
                                                  **body.template_options(reasoning_effort=body.reasoning_effort))
        return self.encode(text, add_special_tokens=False), text

    async def start(self, prompts: list[Prompt], request: SamplingRequest, max_tokens: int | None,
                    logprobs: int | None, structured: StructuredOutput | None, count: int | None = None,
                    prompt_logprobs: int | None = None) -> list[RequestStream]:
        """`count` (default n) engine requests per prompt (prompt-major), all validated before any runs."""
        limits = [self.max_tokens(len(ids), max_tokens) for ids, _ in prompts]
        requests = [(ids, request.sampling_params(limit, logprobs, i, prompt_logprobs, structured), text)
                    for (ids, text), limit in zip(prompts, limits) for i in range(count or request.n)]
        logger.debug("%s: %d prompt(s) of %s tokens, %d sequence(s) each, max_tokens %s, user %r",
                     type(request).__name__, len(prompts), [len(ids) for ids, _ in prompts][:8], count or request.n,
                     max_tokens, request.user)
        return await self.engine.add_all(requests, count or request.n)

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "kiln",
                "root": self.model_name, "parent": None, "max_model_len": self.max_model_len}

    def tokenize(self, body: TokenizeRequest) -> dict:
        """vLLM's /tokenize answer: the ids (and their strings if asked) and the context they must fit."""
        if body.model is not None:
            self.check_model(body.model)
        if body.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
            text = self.tokenizer.apply_chat_template([m.for_template() for m in body.messages], tools=tools,
                                                      **body.template_options())
            special = bool(body.add_special_tokens)
        else:
            text, special = body.prompt, body.add_special_tokens is not False
        try:
            ids = self.tokenizer.encode(text, special, max_tokens=self.tokenize_limit)
        except TooManyTokens as e:
            raise ServerError(400, f"the text has {e.counted} tokens; /tokenize counts at most {self.tokenize_limit}"
                                   f" ({TOKENIZE_CONTEXTS} contexts of this model)", param="prompt") from None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": [self.tokenizer.token_string(t) for t in ids] if body.return_token_strs else None}

    @property
    def tokenize_limit(self) -> int:
        """The most tokens /tokenize and /detokenize handle: their work is bounded like a prompt's."""
        return TOKENIZE_CONTEXTS * self.max_model_len

    def detokenize(self, body: DetokenizeRequest) -> dict:
        if body.model is not None:
            self.check_model(body.model)
        if len(body.tokens) > self.tokenize_limit:
            raise ServerError(400, f"{len(body.tokens)} tokens; /detokenize takes at most {self.tokenize_limit} "
                                   f"({TOKENIZE_CONTEXTS} contexts of this model)", param="tokens")
        vocab = self.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ServerError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}


TOKENIZE_CONTEXTS = 4
"""/tokenize counts texts up to this many contexts long (a client may ask how far over one it is)."""


def _cap(what: str, count: int, limit: int, flag: str) -> None:
    if count > limit:
        raise KilnError(f"the request has {count} {what}; this server takes at most {limit} ({flag} moves the cap)")


class CompletionChoices:
    """Builds /v1/completions choices, whole or as stream chunks, from engine outputs."""

    def __init__(self, server: Server, body: CompletionRequest, prompts: list[Prompt]):
        self.server, self.body, self.prompts = server, body, prompts
        self.echoed: set[int] = set()

    def generated(self, out: RequestOutput) -> int:
        return 0 if self.body.max_tokens == 0 else len(out.token_ids)

    def prompt_text(self, index: int, out: RequestOutput) -> str:
        given = self.prompts[index // self.body.n][1]
        return given if given is not None else self.server.tokenizer.decode(out.prompt_token_ids)

    def choice(self, index: int, out: RequestOutput, text: str, first: int) -> dict:
        """The choice's text from character `text` on and its logprobs from token `first` on; with
        echo, the first chunk of each choice starts with its prompt."""
        body, token_text, end = self.body, self.server.token_text, self.generated(out)
        echo = body.echo and index not in self.echoed
        self.echoed.add(index)
        ids, lps, tops, offset = out.token_ids[first:end], None, None, 0
        if body.logprobs is not None:
            lps = out.logprobs[first:end]
            tops = (out.top_logprobs or [None] * len(out.token_ids))[first:end]
        if echo:
            text = self.prompt_text(index, out) + text
            ids = out.prompt_token_ids + ids
            if body.logprobs is not None:
                lps = out.prompt_logprobs + lps
                tops = (out.prompt_top_logprobs or [None] * len(out.prompt_token_ids)) + tops
        else:
            offset = (len(self.prompt_text(index, out)) if body.echo else 0) + sum(
                len(token_text(t)) for t in out.token_ids[:first])
        reason = "length" if body.max_tokens == 0 else _reason(out)
        result = {"index": index, "text": text, "logprobs": None, "finish_reason": reason,
                  "stop_reason": out.stop_reason if reason == "stop" else None}
        if body.logprobs is not None:
            texts = [token_text(t) for t in ids]
            result["logprobs"] = {
                "tokens": texts, "token_logprobs": lps,
                "top_logprobs": [None if t is None else {token_text(k): v for k, v in t.items()} for t in tops],
                "text_offset": list(itertools.accumulate((len(t) for t in texts), initial=offset))[:-1]}
        if body.prompt_logprobs is not None:
            result["prompt_logprobs"] = _vllm_prompt_logprobs(out, body.prompt_logprobs, token_text)
        return result

    def chunk(self, index: int, out: RequestOutput, chars: int, toks: int) -> dict:
        return self.choice(index, out, out.text[chars:], toks)

    def response(self, head: dict, finals: list[RequestOutput], count: int) -> bytes:
        """The whole answer's JSON; with best_of, per prompt the n choices of highest cumulative logprob."""
        usage = _usage(sum(len(ids) for ids, _ in self.prompts), sum(self.generated(o) for o in finals))
        if count > self.body.n:
            finals = [o for i in range(0, len(finals), count)
                      for o in sorted(finals[i:i + count], key=lambda o: -sum(o.logprobs))[:self.body.n]]
        choices = [self.choice(i, out, out.text if self.generated(out) else "", 0) for i, out in enumerate(finals)]
        return to_json({**head, "choices": choices, "usage": usage})


class ChatChoices:
    """Builds /v1/chat/completions choices, whole or as stream chunks, from engine outputs; with tools
    (tool_choice other than none) each answer's `<tool_call>` blocks become `tool_calls`."""

    def __init__(self, server: Server, body: ChatCompletionRequest):
        self.server, self.body = server, body
        self.tools = bool(body.tools) and body.tool_mode != "none"
        self.parsers: dict[int, tool_calls.CallParser] = {}
        final = body.messages[-1]
        self.echo = final.text() if body.echo and final.role == "assistant" else ""
        """What each answer starts with (vLLM's chat `echo`): the final message's text, if it is the assistant's."""
        self.reasoning = server.config.reasoning_parser
        self.thinking: dict[int, reasoning.ReasoningStream] = {}
        self.answer_sent: dict[int, int] = {}

    def logprobs(self, out: RequestOutput, first: int) -> dict | None:
        if not self.body.logprobs:
            return None
        top, token_text = self.body.top_logprobs or 0, self.server.token_text
        tops = (out.top_logprobs or [None] * len(out.token_ids))[first:]
        content = []
        for token, lp, alts in zip(out.token_ids[first:], out.logprobs[first:], tops):
            s = token_text(token)
            content.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                            "top_logprobs": [{"token": token_text(k), "logprob": v, "bytes": list(token_text(k).encode())}
                                             for k, v in (alts or {}).items()][:top]})
        return {"content": content}

    def finish(self, out: RequestOutput, called: bool) -> dict:
        """finish_reason (tool_calls for an answer that called, as OpenAI says it unless the call was
        named) and vLLM's stop_reason."""
        reason = _reason(out)
        if called and reason == "stop" and not isinstance(self.body.tool_choice, NamedToolChoice):
            reason = "tool_calls"
        return {"finish_reason": reason, "stop_reason": out.stop_reason if reason == "stop" else None}

    def chunk(self, index: int, out: RequestOutput, chars: int, toks: int) -> dict:
        text, delta = out.text, {}
        if self.reasoning is not None:  # the thinking first, then the answer after it
            thought, text = self.thinking.setdefault(index, reasoning.ReasoningStream(self.reasoning)).delta(
                out.text, out.finished)
            if thought:
                delta["reasoning_content"] = thought
            chars, self.answer_sent[index] = self.answer_sent.get(index, 0), len(text)
        if self.tools:
            if index not in self.parsers:
                self.parsers[index] = self.server.tool_format.parser(self.body.tools)
            parser = self.parsers[index]
            delta, called = delta | parser.delta(text, out.finished), parser.calls > 0
        else:
            delta, called = (delta | {"content": text[chars:]} if len(text) > chars else delta), False
        return {"index": index, "delta": delta, "logprobs": self.logprobs(out, toks), **self.finish(out, called)}

    def roles(self, head: dict) -> list[dict]:
        """The first event of each choice: its role (and the echoed text)."""
        return [{**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": self.echo},
                                      "logprobs": None, "finish_reason": None}]} for i in range(self.body.n)]

    def message(self, out: RequestOutput) -> tuple[dict, bool]:
        thought, text = (None, out.text) if self.reasoning is None else reasoning.split(out.text, self.reasoning, True)
        content, calls = self.server.tool_format.parse(text, self.body.tools) if self.tools else (text, [])
        message = {"role": "assistant", "content": self.echo + (content or "") if self.echo else content}
        if self.reasoning is not None:
            message["reasoning_content"] = thought or None
        if calls:
            message["tool_calls"] = calls
        return message, bool(calls)

    def response(self, head: dict, finals: list[RequestOutput], prompt_tokens: int) -> bytes:
        choices = []
        for i, out in enumerate(finals):
            message, called = self.message(out)
            choices.append({"index": i, "message": message, "logprobs": self.logprobs(out, 0),
                            **self.finish(out, called)})
        usage = _usage(prompt_tokens, sum(len(o.token_ids) for o in finals))
        return to_json({**head, "choices": choices, "usage": usage})


async def complete(server: Server, body: CompletionRequest, request: Request) -> Response:
    """/v1/completions: every prompt's choices, whole or streamed."""
    server.check_model(body.model)
    server.check_limits(body)
    count = body.sequences  # sequences per prompt; the n most likely are returned
    server.engine.admit(_prompt_count(body.prompt) * count)
    prompts = await off_loop(server.completion_prompts, body.prompt)
    structured = await off_loop(server.constraint, body)
    scored = body.logprobs if body.echo and body.logprobs is not None else None
    prompt_logprobs = max((k for k in (scored, body.prompt_logprobs) if k is not None), default=None)
    logprobs = body.logprobs if body.logprobs is not None or count == body.n else 0  # ranking needs them
    streams = await server.start(prompts, body, 1 if body.max_tokens == 0 else body.max_tokens, logprobs,
                                 structured, count, prompt_logprobs)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": server.model_name}
    choices = CompletionChoices(server, body, prompts)
    if body.stream:
        return event_stream(streams, head, choices.chunk, sum(len(ids) for ids, _ in prompts),
                            body.stream_options)
    done = await finals(streams, request)
    if done is None:
        return Response(status_code=499)  # nobody reads it: nginx's status for a client that left
    return Response(await off_loop(choices.response, head, done, count), media_type="application/json")


async def chat(server: Server, body: ChatCompletionRequest, request: Request) -> Response:
    """/v1/chat/completions: the conversation's choices, whole or streamed."""
    server.check_model(body.model)
    server.check_limits(body)
    server.engine.admit(body.n)
    body = server.with_tool_marker(body)
    prompt = await off_loop(server.chat_prompt, body)
    structured = await off_loop(server.constraint, body)
    top = body.top_logprobs or 0
    if body.max_completion_tokens is not None and body.max_tokens is not None:  # the first wins; both must fit
        server.max_tokens(len(prompt[0]), body.max_tokens)
    streams = await server.start([prompt], body, body.max_completion_tokens or body.max_tokens,
                                 top if body.logprobs else None, structured)
    prompt_tokens = len(prompt[0])  # counted once, whatever n is (as OpenAI and vLLM do)
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": server.model_name}
    choices = ChatChoices(server, body)
    if body.stream:
        head = {**head, "object": "chat.completion.chunk"}
        return event_stream(streams, head, choices.chunk, prompt_tokens, body.stream_options, choices.roles(head))
    done = await finals(streams, request)
    if done is None:
        return Response(status_code=499)  # nobody reads it: nginx's status for a client that left
    answer = await off_loop(choices.response, {**head, "object": "chat.completion"}, done, prompt_tokens)
    return Response(answer, media_type="application/json")


async def embed(server: Server, body: EmbeddingRequest, request: Request) -> Response:
    """/v1/embeddings: each input's final hidden states pooled (`--pooling`) and L2-normalized."""
    server.check_model(body.model)
    server.engine.admit(_prompt_count(body.input))
    prompts = await off_loop(server.completion_prompts, body.input)
    params = SamplingParams(max_tokens=1, pooling=server.config.pooling)
    logger.debug("EmbeddingRequest: %d input(s) of %s tokens, user %r", len(prompts), [len(ids) for ids, _ in prompts][:8],
                 body.user)
    streams = await server.engine.add_all([(ids, params, text) for ids, text in prompts])
    done = await finals(streams, request)
    if done is None:
        return Response(status_code=499)  # nobody reads it: nginx's status for a client that left
    tokens = sum(len(ids) for ids, _ in prompts)

    def vector(values: list[float]):
        return values if body.encoding_format == "float" else base64.b64encode(
            struct.pack(f"<{len(values)}f", *values)).decode()

    data = [{"object": "embedding", "index": i, "embedding": vector(out.embedding)} for i, out in enumerate(done)]
    return Response(to_json({"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                             "model": server.model_name, "data": data,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}),
                    media_type="application/json")


def _prompt_count(prompt) -> int:
    """How many prompts a completion body holds, before any is tokenized."""
    return len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else 1


def event_stream(streams: list[RequestStream], head: dict, choice: Callable[[int, RequestOutput, int, int], dict],
                 prompt_tokens: int, options: StreamOptions | None, preamble: list[dict] | None = None
                 ) -> StreamingResponse:
    """Server-sent events: `preamble`, then a chunk whenever a choice has new text (and its last one),
    built by `choice(index, output, characters sent, tokens sent)`; usage if asked (at the end, or with
`continuous_usage_stats` in every chunk too, as vLLM sends it); `[DONE]`. Once
    the status is sent a failure can only be told in the stream: an error event, as vLLM does."""

    continuous = options is not None and options.continuous_usage_stats

    def with_usage(payload: dict, generated: int) -> dict:
        return {**payload, "usage": _usage(prompt_tokens, generated)} if continuous else payload

    async def events() -> AsyncIterator[str]:
        for payload in preamble or []:
            yield _sse(with_usage(payload, 0))
        sent: dict[int, tuple[int, int]] = {}  # choice index -> (characters, tokens) sent
        generated = 0  # tokens of all choices so far
        try:
            async for index, out in merged(streams):
                chars, toks = sent.get(index, (0, 0))
                sent[index] = (len(out.text), len(out.token_ids))
                generated += len(out.token_ids) - toks
                if len(out.text) > chars or out.finished:
                    yield _sse(with_usage({**head, "choices": [choice(index, out, chars, toks)]}, generated))
        except Exception as e:  # noqa: BLE001 - whatever it is, the client gets an event, not a cut stream
            yield _sse(stream_error(e))
            yield "data: [DONE]\n\n"
            return
        if options and options.include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(prompt_tokens, generated)})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from all streams as they come; closing this aborts the unfinished ones."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((index, out))
        except Exception as e:  # handed to the consumer; a cancellation ends the task
            await queue.put((index, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, out = await queue.get()
            if isinstance(out, BaseException):
                raise out
            if out.finished:
                remaining -= 1
            yield index, out
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            stream.abort()


async def finals(streams: list[RequestStream], request: Request) -> list[RequestOutput] | None:
    """Each stream's finished output, in choice order; None if the client left first, which aborts
    them all (Starlette cancels a streamed response on disconnect, but not a route still awaiting)."""

    async def collect() -> list[RequestOutput]:
        done: list[RequestOutput | None] = [None] * len(streams)
        async for index, out in merged(streams):
            if out.finished:
                done[index] = out
        return done

    async def disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    answer, gone = asyncio.create_task(collect()), asyncio.create_task(disconnect())
    try:
        await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not answer.done():
            answer.cancel()  # its `merged` aborts the unfinished streams
        await asyncio.gather(answer, gone, return_exceptions=True)
    if answer.cancelled():
        logger.info("client left %s before its answer: aborted %d request(s)", request.url.path, len(streams))
        return None
    return answer.result()


async def off_loop(fn: Callable, *args):
    """`fn(*args)` on a worker thread: work that grows with the request never holds the event loop."""
    return await run_in_threadpool(fn, *args)


async def read_body(request: Request, model: type[Body]) -> Body:
    """The request body as `model`, parsed and validated on a worker thread (`BodyLimit` has bounded
    its size); a 400 naming the field otherwise."""
    raw = await request.body()
    try:
        return await off_loop(model.model_validate_json, raw)
    except ValidationError as e:
        message, param = validation_message(e, model)
        raise ServerError(400, message, param=param) from None


def _vllm_prompt_logprobs(out: RequestOutput, top: int, token_text: Callable[[int], str]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id: {logprob, rank,
    decoded_token}} for the prompt's token and the `top` most likely."""
    result: list[dict | None] = [None]
    tops = out.prompt_top_logprobs or [None] * len(out.prompt_token_ids)
    for token, lp, rank, alts in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:], out.prompt_ranks[1:],
                                     tops[1:]):
        entry = {str(token): {"logprob": lp, "rank": rank, "decoded_token": token_text(token)}}
        for r, (k, v) in enumerate((alts or {}).items(), start=1):
            entry.setdefault(str(k), {"logprob": v, "rank": r, "decoded_token": token_text(k)})
        result.append(entry)
    return result


def _reason(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finish_reason in ("stop", "length") else None


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(payload: dict) -> str:
    return f"data: {to_json(payload).decode()}\n\n"
