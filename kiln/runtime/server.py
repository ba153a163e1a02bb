"""The OpenAI-compatible HTTP API (DESIGN.md section 7): FastAPI routes over an `AsyncEngine`.

Every error, from malformed JSON to a prompt longer than the context, is answered in OpenAI's error
shape with a 4xx; a client that disconnects, mid-stream or while waiting for a whole answer, aborts
its requests.
"""

import asyncio
import contextlib
import hmac
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException

from kiln.config import ServerConfig
from kiln.errors import KilnError
from kiln.runtime.async_engine import (AsyncEngine, EngineUnavailable, Overloaded, RequestStream, RequestTimedOut,
                                       StepFailed)
from kiln.runtime.engine import RequestOutput
from kiln.runtime.lockstep import StepFeed
from kiln.runtime.metrics import CONTENT_TYPE
from kiln.runtime.sampler import SamplingParams
from kiln.runtime.structured_output import StructuredOutput
from kiln.runtime.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


# -- request bodies ----------------------------------------------------------------------------------

class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(max_length=64)
    description: str | None = None
    json_schema: dict = Field(alias="schema", description="the JSON schema the output must match")
    strict: bool | None = Field(None, description="kiln's output always matches the schema")


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _check(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema goes with type json_schema, and only with it")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of its constraints."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None


def _constraint(kind: str, value) -> StructuredOutput:
    if kind == "json":
        return StructuredOutput.json_schema(value)
    return StructuredOutput(kind, tuple(value) if kind == "choice" else value)


class _Sampling(BaseModel):
    """Fields completions and chat share. A field kiln does not implement is refused with a 400
    naming it (`extra="forbid"`): accepted and ignored, it would give wrong answers silently."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0, le=1)
    n: int = Field(1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, ge=0.01, le=100)
    logit_bias: dict[str, float] | None = Field(None, description="token id (a string, as in JSON) -> bias in "
                                                "[-100, 100]")
    min_tokens: int = Field(0, ge=0)
    user: str | None = Field(None, description="an end-user id for the logs; it changes no output")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | str | None = Field(None, description="vLLM's: a JSON schema the output matches")
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = Field(None, description="a Lark or GBNF grammar")

    def structured_output(self) -> StructuredOutput | None:
        """The one output constraint the request asks for, whichever field it came in."""
        found: list[tuple[str, StructuredOutput]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutput.json_object()))
        if rf is not None and rf.type == "json_schema":
            found.append(("response_format", StructuredOutput.json_schema(rf.json_schema.json_schema)))
        so = self.structured_outputs
        if so is not None:
            for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                ("grammar", so.grammar)):
                if value is not None:
                    found.append((f"structured_outputs.{name}", _constraint(name, value)))
            if so.json_object:
                found.append(("structured_outputs.json_object", StructuredOutput.json_object()))
        for name in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{name}")
            if value is not None:
                found.append((f"guided_{name}", _constraint(name, value)))
        if len(found) > 1:
            raise ServerError(400, f"{found[0][0]} and {found[1][0]} both constrain the output: give one")
        return found[0][1] if found else None

    def sampling_params(self, max_tokens: int, logprobs: int | None, index: int,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p,
            seed=None if self.seed is None else self.seed + index, stop=stop,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias={int(t): v for t, v in (self.logit_bias or {}).items()}, min_tokens=min(self.min_tokens, max_tokens),
            structured_output=self.structured_output(),
        )

    @model_validator(mode="after")
    def _check_biases(self):
        if any(not -100 <= v <= 100 for v in (self.logit_bias or {}).values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if any(not t.isdigit() for t in self.logit_bias or {}):
            raise ValueError("logit_bias keys must be token ids (non-negative integers)")
        return self


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0, description="0 only with echo: score the prompt, generate nothing")
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = Field(False, description="the prompt before the completion, with its logprobs if logprobs is set")
    best_of: int | None = Field(None, ge=1, le=16, description="sample this many, return the n most likely")
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description="vLLM's: logprobs of the prompt tokens")
    suffix: str | None = Field(None, description="not supported: only null or empty")

    @model_validator(mode="after")
    def _check(self):
        if self.suffix:
            raise ValueError("suffix: kiln does not insert text (no fill-in-the-middle); leave it out")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be >= n ({self.n})")
        if self.stream and (self.best_of or self.n) > self.n:
            raise ValueError("best_of > n cannot stream: the best choices are known only at the end")
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs cannot stream; ask without stream")
        if self.max_tokens == 0 and (self.stream or not self.echo):
            raise ValueError("max_tokens 0 generates nothing: set echo (without stream) to score the prompt, "
                             "or ask for >= 1")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = Field(None, max_length=0, description="not supported: only null or empty")
    tool_choice: Literal["none"] | None = None


# -- errors ------------------------------------------------------------------------------------------

class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, for every status the server answers with other than 200."""

    error: ErrorDetail


def _errors(*statuses: int) -> dict:
    """OpenAPI entries for the error statuses a route answers with (the schema lists exactly these)."""
    said = {400: "invalid request: the message names the field or the problem",
            401: "no API key, or a wrong one (`Authorization: Bearer KEY`)", 404: "unknown model",
            405: "method not allowed (the Allow header lists the allowed ones)",
            408: "the request ran past the server's request timeout and was stopped",
            499: "the client closed the connection before the answer (nobody reads this one)",
            500: "a failure inside the server",
            503: "the engine is not running, or the server is at capacity (then Retry-After says when to retry)"}
    return {s: {"model": ErrorResponse, "description": said[s]} for s in statuses}


GENERATION_RESPONSES = {
    200: {"description": "the completion; with stream, server-sent events ending in `data: [DONE]`",
          "content": {"application/json": {}, "text/event-stream": {}}},
    **_errors(400, 404, 405, 408, 499, 500, 503),
}

def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> JSONResponse:
    """OpenAI's error shape."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    param = ".".join(loc) or None
    if first.get("type") == "extra_forbidden":
        return (f"`{param}` is not supported by kiln: leave it out (kiln refuses a field rather than "
                "ignore it)"), param
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"{param or 'body'}: {message}", param


class ServerError(Exception):
    """A 4xx the route decided on, raised from deep in request handling."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code


class ApiKeyMiddleware:
    """Answers 401 in OpenAI's shape to a request without `Authorization: Bearer <key>`, before its
    body is read; `exempt` paths pass (probes, scrapers). Pure ASGI: streaming and disconnects pass
    through untouched."""

    def __init__(self, app, key: str, exempt: tuple[str, ...] = ()):
        self.app, self._key, self._exempt = app, key.encode(), set(exempt)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self._exempt:
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
            return await self.app(scope, receive, send)
        message = ("the API key is not valid" if given else
                   "no API key: send `Authorization: Bearer <key>` (this server requires one)")
        response = error(401, message, code="invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


# -- the app -----------------------------------------------------------------------------------------

class Server:
    """Turns API requests into engine requests and engine outputs into API responses."""

    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, model_name: str, max_model_len: int):
        self.engine, self.tokenizer = engine, tokenizer
        self.model_name, self.max_model_len = model_name, max_model_len
        self.created = int(time.time())

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ServerError(404, f"the model `{name}` does not exist; this server serves `{self.model_name}`",
                              "NotFoundError", "model_not_found")

    def max_tokens(self, prompt_len: int, asked: int | None) -> int:
        room = self.max_model_len - prompt_len
        if room < 1:
            raise ServerError(400, f"the prompt has {prompt_len} tokens; this model's context is "
                                   f"{self.max_model_len} tokens, which leaves no room to generate")
        if asked is not None and asked > room:
            raise ServerError(400, f"max_tokens {asked} + the prompt's {prompt_len} tokens exceed the model's "
                                   f"context of {self.max_model_len} tokens")
        return asked if asked is not None else room

    def start(self, prompts: list[tuple[list[int], str | None]], request: _Sampling, max_tokens: int | None,
              logprobs: int | None, count: int | None = None, prompt_logprobs: int | None = None
              ) -> list[RequestStream]:
        """`count` (default n) engine requests per prompt (prompt-major), all validated before any runs."""
        streams: list[RequestStream] = []
        limits = [self.max_tokens(len(ids), max_tokens) for ids, _ in prompts]
        self.engine.admit(len(prompts) * (count or request.n))
        try:
            for (ids, text), limit in zip(prompts, limits):
                for i in range(count or request.n):
                    params = request.sampling_params(limit, logprobs, i, prompt_logprobs)
                    streams.append(self.engine.add(ids, params, text))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def create_app(engine: AsyncEngine, tokenizer: Tokenizer, model_name: str, max_model_len: int,
               on_ready: Callable[[], None] | None = None, config: ServerConfig | None = None) -> FastAPI:
    """The app over a started `engine`. `config` brings the API key and CORS origins (its queue
    limit and timeout are the engine's: `AsyncEngine(max_queued=, request_timeout=)`)."""
    config = config or ServerConfig()
    server = Server(engine, tokenizer, model_name, max_model_len)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if on_ready is not None:
            on_ready()
        yield

    app = FastAPI(title="kiln", summary="OpenAI-compatible completions over compiled kiln artifacts",
                  lifespan=lifespan)
    app.state.server = server
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, key=config.api_key, exempt=config.auth_exempt)
    if config.allowed_origins:  # outermost: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error(400, message, param=param)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        response = error(exc.status_code, str(exc.detail), kind)
        response.headers.update(exc.headers or {})  # a 405's Allow
        return response

    @app.exception_handler(ServerError)
    async def _server_error(request: Request, exc: ServerError) -> JSONResponse:
        return error(exc.status, str(exc), exc.kind, code=exc.code)

    @app.exception_handler(KilnError)
    async def _kiln_error(request: Request, exc: KilnError) -> JSONResponse:
        return error(400, str(exc))

    @app.exception_handler(StepFailed)
    async def _step_failed(request: Request, exc: StepFailed) -> JSONResponse:
        return error(500, str(exc), "server_error")

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(request: Request, exc: EngineUnavailable) -> JSONResponse:
        return error(503, str(exc), "server_error")

    @app.exception_handler(Overloaded)
    async def _overloaded(request: Request, exc: Overloaded) -> JSONResponse:
        response = error(503, str(exc), "server_error", code="overloaded")
        response.headers["Retry-After"] = "1"
        return response

    @app.exception_handler(RequestTimedOut)
    async def _timed_out(request: Request, exc: RequestTimedOut) -> JSONResponse:
        return error(408, str(exc), "timeout_error")

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:  # never expected: logged with its trace
        logger.exception("error serving %s %s", request.method, request.url.path)
        return error(500, f"internal error: {type(exc).__name__}", "server_error")

    @app.get("/health", responses={200: {"description": "the engine serves"}, **_errors(405, 503)})
    async def health() -> Response:
        if not engine.healthy:
            return error(503, f"the engine is not running ({engine.error})", "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models", responses=_errors(405))
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": server.created,
                                            "owned_by": "kiln", "max_model_len": max_model_len}]}

    @app.get("/metrics", response_class=Response, responses={
        200: {"description": "Prometheus text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}},
        **_errors(405)})
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        prompts = _completion_prompts(body.prompt, tokenizer)
        scored = body.logprobs if body.echo and body.logprobs is not None else None
        prompt_logprobs = max((k for k in (scored, body.prompt_logprobs) if k is not None), default=None)
        count = body.best_of or body.n  # sequences per prompt; the n most likely are returned
        ranked = count > body.n
        logprobs = body.logprobs if body.logprobs is not None or not ranked else 0  # ranking needs them
        streams = server.start(prompts, body, 1 if body.max_tokens == 0 else body.max_tokens, logprobs, count,
                               prompt_logprobs)
        request_id, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_tokens = sum(len(ids) for ids, _ in prompts) * count
        head = {"id": request_id, "object": "text_completion", "created": created, "model": model_name}
        generated = (lambda out: 0) if body.max_tokens == 0 else (lambda out: len(out.token_ids))
        echoed: set[int] = set()

        def prompt_text(index: int, out: RequestOutput) -> str:
            given = prompts[index // body.n][1]
            return given if given is not None else tokenizer.decode(out.prompt_token_ids)

        def choice(index: int, out: RequestOutput, text: str, first: int) -> dict:
            """The choice's text from character `text` on and its logprobs from token `first` on; with
            echo, the first chunk of each choice starts with its prompt."""
            echo = body.echo and index not in echoed
            echoed.add(index)
            ids, lps, tops, offset = out.token_ids[first:generated(out)], None, None, 0
            if body.logprobs is not None:
                lps = out.logprobs[first:generated(out)]
                tops = (out.top_logprobs or [None] * len(out.token_ids))[first:generated(out)]
            if echo:
                text = prompt_text(index, out) + text
                ids = out.prompt_token_ids + ids
                if body.logprobs is not None:
                    lps = out.prompt_logprobs + lps
                    tops = (out.prompt_top_logprobs or [None] * len(out.prompt_token_ids)) + tops
            else:
                offset = (len(prompt_text(index, out)) if body.echo else 0) + sum(
                    len(server.token_text(t)) for t in out.token_ids[:first])
            reason = "length" if body.max_tokens == 0 else _reason(out)
            result = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
            if body.logprobs is not None:
                texts = [server.token_text(t) for t in ids]
                result["logprobs"] = {
                    "tokens": texts, "token_logprobs": lps,
                    "top_logprobs": [None if t is None else {server.token_text(k): v for k, v in t.items()}
                                     for t in tops],
                    "text_offset": list(itertools.accumulate((len(t) for t in texts), initial=offset))[:-1]}
            if body.prompt_logprobs is not None:
                result["prompt_logprobs"] = _vllm_prompt_logprobs(out, body.prompt_logprobs, server.token_text)
            return result

        if body.stream:
            return _event_stream(streams, head, lambda i, out, chars, toks: choice(i, out, out.text[chars:], toks),
                                 prompt_tokens, body.stream_options)
        finals = await _finals(streams, request)
        if finals is None:
            return Response(status_code=499)  # nobody reads it: nginx's status for a client that left
        usage = _usage(prompt_tokens, sum(generated(o) for o in finals))
        if ranked:  # per prompt, the n choices of highest cumulative logprob
            finals = [o for i in range(0, len(finals), count)
                      for o in sorted(finals[i:i + count], key=lambda o: -sum(o.logprobs))[:body.n]]
        choices = [choice(i, out, out.text if generated(out) else "", 0) for i, out in enumerate(finals)]
        return JSONResponse({**head, "choices": choices, "usage": usage})

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        text = tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages])
        ids = tokenizer.encode(text, add_special_tokens=False)
        top = body.top_logprobs or 0
        streams = server.start([(ids, text)], body, body.max_completion_tokens or body.max_tokens,
                               top if body.logprobs else None)
        request_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        prompt_tokens = len(ids) * body.n

        def logprobs(out: RequestOutput, first: int) -> dict | None:
            if not body.logprobs:
                return None
            tops = (out.top_logprobs or [None] * len(out.token_ids))[first:]
            content = []
            for token, lp, alts in zip(out.token_ids[first:], out.logprobs[first:], tops):
                s = server.token_text(token)
                content.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                                "top_logprobs": [{"token": server.token_text(k), "logprob": v,
                                                  "bytes": list(server.token_text(k).encode())}
                                                 for k, v in (alts or {}).items()][:top]})
            return {"content": content}

        if body.stream:
            head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model_name}

            def chunk(index: int, out: RequestOutput, chars: int, toks: int) -> dict:
                delta = {"content": out.text[chars:]} if len(out.text) > chars else {}
                return {"index": index, "delta": delta, "logprobs": logprobs(out, toks), "finish_reason": _reason(out)}

            roles = [{**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                           "finish_reason": None}]} for i in range(body.n)]
            return _event_stream(streams, head, chunk, prompt_tokens, body.stream_options, roles)
        finals = await _finals(streams, request)
        if finals is None:
            return Response(status_code=499)  # nobody reads it: nginx's status for a client that left
        choices = [{"index": i, "message": {"role": "assistant", "content": out.text}, "logprobs": logprobs(out, 0),
                    "finish_reason": _reason(out)} for i, out in enumerate(finals)]
        return JSONResponse({"id": request_id, "object": "chat.completion", "created": created, "model": model_name,
                             "choices": choices, "usage": _usage(prompt_tokens, sum(len(o.token_ids) for o in finals))})

    generate_schema = app.openapi

    def openapi() -> dict:
        """FastAPI's schema without its 422s (bad input is answered 400 in OpenAI's shape instead), and
        with `model` naming the one model served (any other name is a 404)."""
        if app.openapi_schema is None:
            schema = generate_schema()
            for name in ("CompletionRequest", "ChatCompletionRequest"):
                schema["components"]["schemas"][name]["properties"]["model"]["enum"] = [model_name]
            for operations in schema["paths"].values():
                for operation in operations.values():
                    operation["responses"].pop("422", None)
            schema["components"]["schemas"].pop("HTTPValidationError", None)
            schema["components"]["schemas"].pop("ValidationError", None)
            if config.api_key is not None:
                schema["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
                for path, operations in schema["paths"].items():
                    if path in config.auth_exempt:
                        continue
                    for operation in operations.values():
                        operation["security"] = [{"apiKey": []}]
                        operation["responses"].update({"401": {
                            "description": _errors(401)[401]["description"],
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}})
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


def _event_stream(streams: list[RequestStream], head: dict, choice: Callable[[int, RequestOutput, int, int], dict],
                  prompt_tokens: int, options: StreamOptions | None, preamble: list[dict] | None = None
                  ) -> StreamingResponse:
    """Server-sent events: `preamble`, then a chunk whenever a choice has new text (and its last one),
    built by `choice(index, output, characters sent, tokens sent)`; usage if asked; `[DONE]`."""

    async def events() -> AsyncIterator[str]:
        for payload in preamble or []:
            yield _sse(payload)
        sent: dict[int, tuple[int, int]] = {}  # choice index -> (characters, tokens) sent
        completion_tokens = 0
        try:
            async for index, out in _merged(streams):
                chars, toks = sent.get(index, (0, 0))
                sent[index] = (len(out.text), len(out.token_ids))
                if out.finished:
                    completion_tokens += len(out.token_ids)
                if len(out.text) > chars or out.finished:
                    yield _sse({**head, "choices": [choice(index, out, chars, toks)]})
        except (StepFailed, EngineUnavailable, RequestTimedOut) as e:  # the status is sent: an error event, as vLLM
            kind = "timeout_error" if isinstance(e, RequestTimedOut) else "server_error"
            yield _sse({"error": {"message": str(e), "type": kind, "param": None, "code": None}})
            yield "data: [DONE]\n\n"
            return
        if options and options.include_usage:
            yield _sse({**head, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


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


def _completion_prompts(prompt, tokenizer: Tokenizer) -> list[tuple[list[int], str | None]]:
    """A string, a list of strings, a list of token ids, or a list of those -> [(ids, text or None)]."""
    if isinstance(prompt, str):
        return [(tokenizer.encode(prompt), prompt)]
    if not prompt:
        raise KilnError("the prompt is empty: give text or at least one token id")
    if isinstance(prompt[0], int):
        return [(list(prompt), None)]
    if isinstance(prompt[0], str):
        return [(tokenizer.encode(p), p) for p in prompt]
    return [(list(p), None) for p in prompt]


async def _finals(streams: list[RequestStream], request: Request) -> list[RequestOutput] | None:
    """Each stream's finished output, in choice order; None if the client left first, which aborts
    them all (Starlette cancels a streamed response on disconnect, but not a route still awaiting)."""

    async def collect() -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for index, out in _merged(streams):
            if out.finished:
                finals[index] = out
        return finals

    async def disconnect() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    answer, gone = asyncio.create_task(collect()), asyncio.create_task(disconnect())
    try:
        await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not answer.done():
            answer.cancel()  # its `_merged` aborts the unfinished streams
        await asyncio.gather(answer, gone, return_exceptions=True)
    if answer.cancelled():
        logger.info("client left %s before its answer: aborted %d request(s)", request.url.path, len(streams))
        return None
    return answer.result()


def warm_up(llm) -> None:
    """One short request through every stage before the first user's; every rank runs it."""
    if llm.tokenizer is None:
        raise KilnError("serving needs a tokenizer.json in the model directory")
    start = time.perf_counter()
    warm = llm.engine.add_request(llm.tokenizer.encode("warm up") or [0], SamplingParams(max_tokens=2, temperature=0))
    while llm.engine.has_unfinished():
        llm.engine.step()
    logger.info("warm-up step (request %s) in %.2fs", warm, time.perf_counter() - start)


def serve(llm, config: ServerConfig | None = None, model_name: str | None = None,
          feed: StepFeed | None = None) -> None:
    """Serve `llm` (a loaded `kiln.LLM`) until interrupted: warm up, start the engine thread, listen.
    Under tensor parallelism this is rank 0, and `feed` carries each step's requests to the others."""
    import uvicorn

    config = config or ServerConfig()
    warm_up(llm)
    name = model_name or llm.model_dir.name
    engine = AsyncEngine(llm.engine, feed=feed, model_name=name, max_queued=config.max_queued_requests,
                         request_timeout=config.request_timeout)
    engine.start()
    url = f"{config.scheme}://{config.host}:{config.port}"
    app = create_app(engine, llm.tokenizer, name, llm.engine.max_model_len, config=config,
                     on_ready=lambda: logger.info("ready: %s serves %s", url, name))
    try:
        uvicorn.run(app, host=config.host, port=config.port, log_level="warning", ssl_keyfile=config.ssl_keyfile,
                    ssl_certfile=config.ssl_certfile, ssl_ciphers=config.ssl_ciphers)
    finally:
        engine.shutdown()
