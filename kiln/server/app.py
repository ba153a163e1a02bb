"""The OpenAI-compatible HTTP API: the route table over an `AsyncEngine`, its
OpenAPI schema, and `serve`, which runs it under uvicorn.

Every error, from malformed JSON to a prompt longer than the context, is answered in OpenAI's error
shape with a 4xx (`errors`); a client that disconnects, mid-stream or while waiting for a whole answer,
aborts its requests. Bodies are bounded (`http_limits`), parsed and prepared off the event loop
(`serving`); one request's failure is its own (`RequestFailed`), and if the engine thread ever stops,
`serve` returns with an error so that the process exits and a supervisor restarts it.
"""

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response
from pydantic import BaseModel

from kiln import __version__
from kiln.config import ServerConfig
from kiln.errors import KilnError
from kiln.runtime.async_engine import AsyncEngine, EngineUnavailable
from kiln.runtime.lockstep import StepFeed
from kiln.runtime.metrics import CONTENT_TYPE
from kiln.runtime.sampler import SamplingParams
from kiln.runtime.tokenizer import Tokenizer
from kiln.server.errors import ApiKeyMiddleware, KilnJSONResponse, add_error_handlers, error, needs_key
from kiln.server.http_limits import BodyLimit, guarded_protocol
from kiln.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, EmbeddingRequest,
                                  ErrorResponse, TokenizeRequest)
from kiln.server.responses import ResponsesRequest, ResponseStore, respond
from kiln.server.serving import Server, chat, complete, embed, off_loop, read_body

logger = logging.getLogger(__name__)


def _errors(*statuses: int) -> dict:
    """OpenAPI entries for the error statuses a route answers with (the schema lists exactly these)."""
    said = {400: "invalid request: the message names the field or the problem",
            401: "no API key, or a wrong one (`Authorization: Bearer KEY`)", 404: "unknown model",
            405: "method not allowed (the Allow header lists the allowed ones)",
            408: "the request ran past the server's request timeout, or its body past the body timeout",
            413: "the request body is larger than the server takes (--max-request-bytes)",
            499: "the client closed the connection before the answer (nobody reads this one)",
            500: "a failure inside the server",
            503: "the engine is not running, or the server is at capacity (then Retry-After says when to retry)"}
    return {s: {"model": ErrorResponse, "description": said[s]} for s in statuses}


GENERATION_RESPONSES = {
    200: {"description": "the completion; with stream, server-sent events ending in `data: [DONE]`",
          "content": {"application/json": {}, "text/event-stream": {}}},
    **_errors(400, 404, 405, 408, 413, 499, 500, 503),
}


def _body_schema(model: type[BaseModel]) -> dict:
    """The OpenAPI request body of a route that parses its own (off the event loop: `serving.read_body`)."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def create_app(engine: AsyncEngine, tokenizer: Tokenizer, model_name: str, max_model_len: int,
               on_ready: Callable[[], None] | None = None, config: ServerConfig | None = None) -> FastAPI:
    """The app over a started `engine`. `config` brings the API key, CORS origins, the body limits and
    the per-request caps; its listening options (host, port, TLS, header and keep-alive timeouts) are
    `serve`'s, and its queue limit and timeout the engine's (`AsyncEngine(max_queued=, request_timeout=)`)."""
    config = config or ServerConfig()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if on_ready is not None:
            on_ready()
        yield

    app = FastAPI(title="kiln", summary="OpenAI-compatible completions over compiled kiln artifacts",
                  lifespan=lifespan, default_response_class=KilnJSONResponse)
    vocab = engine.engine.model_config.vocab_size  # the bound the engine checks token ids against
    app.state.server = Server(engine, tokenizer, model_name, max_model_len, config, vocab)
    app.state.responses = ResponseStore(config.max_stored_responses)
    app.add_middleware(BodyLimit, max_bytes=config.max_request_bytes, timeout=config.body_timeout)
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, key=config.api_key, scope=config.api_key_scope,
                           exempt=config.auth_exempt)
    if config.allowed_origins:  # outermost: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    add_error_handlers(app)
    _add_routes(app)
    app.openapi = _openapi(app, model_name, max_model_len, vocab, config)
    return app


def _add_routes(app: FastAPI) -> None:
    """The route table; each route finds its `Server` on the app's state."""
    app.add_api_route("/health", health, methods=["GET"],
                      responses={200: {"description": "the engine serves"}, **_errors(405, 503)})
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)  # probes that send HEAD
    app.add_api_route("/version", version, methods=["GET"], responses=_errors(405))
    app.add_api_route("/v1/models", models, methods=["GET"], responses=_errors(405))
    app.add_api_route("/v1/models/{model_id:path}", model, methods=["GET"], responses=_errors(404, 405))
    app.add_api_route("/metrics", metrics, methods=["GET"], response_class=Response, responses={
        200: {"description": "Prometheus text exposition", "content": {"text/plain": {"schema": {"type": "string"}}}},
        **_errors(405)})
    app.add_api_route("/v1/completions", completions, methods=["POST"], responses=GENERATION_RESPONSES,
                      openapi_extra=_body_schema(CompletionRequest))
    app.add_api_route("/v1/chat/completions", chat_completions, methods=["POST"], responses=GENERATION_RESPONSES,
                      openapi_extra=_body_schema(ChatCompletionRequest))
    app.add_api_route("/v1/embeddings", embeddings, methods=["POST"], responses={
        200: {"description": "each input's embedding", "content": {"application/json": {}}},
        **_errors(400, 404, 405, 408, 413, 499, 500, 503)}, openapi_extra=_body_schema(EmbeddingRequest))
    app.add_api_route("/v1/responses", responses, methods=["POST"], responses=GENERATION_RESPONSES,
                      openapi_extra=_body_schema(ResponsesRequest))
    app.add_api_route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"],
                      responses=_errors(404, 405))  # one route: a 405's Allow names both
    app.add_api_route("/tokenize", tokenize, methods=["POST"], responses=_errors(400, 404, 405, 408, 413),
                      openapi_extra=_body_schema(TokenizeRequest))
    app.add_api_route("/detokenize", detokenize, methods=["POST"], responses=_errors(400, 404, 405, 408, 413),
                      openapi_extra=_body_schema(DetokenizeRequest))


def _server(request: Request) -> Server:
    """The `Server` that `create_app` put on the app's state."""
    return request.app.state.server


# The routes carry comments, not docstrings: FastAPI would publish a docstring as the operation's
# description in the OpenAPI schema.

async def health(request: Request) -> Response:  # 200 while the engine runs and admits, else 503 naming why
    engine = _server(request).engine
    if not engine.healthy:
        return error(503, f"the engine is not running ({engine.error})")
    if engine.closing is not None:
        return error(503, engine.closing)
    return KilnJSONResponse({"status": "ok"})


async def version(request: Request) -> dict:  # kiln's version, as vLLM's /version gives its own
    return {"version": __version__}


async def models(request: Request) -> dict:  # the one model served, in OpenAI's list shape
    return {"object": "list", "data": [_server(request).model_card()]}


async def model(request: Request, model_id: str) -> dict:  # the openai client's models.retrieve
    server = _server(request)
    server.check_model(model_id)
    return server.model_card()


async def metrics(request: Request) -> Response:  # Prometheus text
    return Response(_server(request).engine.metrics.render(), media_type=CONTENT_TYPE)


async def completions(request: Request) -> Response:  # the body parsed off the event loop, not by FastAPI
    return await complete(_server(request), await read_body(request, CompletionRequest), request)


async def chat_completions(request: Request) -> Response:  # as completions
    return await chat(_server(request), await read_body(request, ChatCompletionRequest), request)


async def embeddings(request: Request) -> Response:  # each input's pooled final hidden states
    return await embed(_server(request), await read_body(request, EmbeddingRequest), request)


async def responses(request: Request) -> Response:  # OpenAI's Responses API over the chat path
    return await respond(_server(request), request.app.state.responses, await read_body(request, ResponsesRequest),
                         request)


async def stored_response(response_id: str, request: Request) -> Response:
    """GET: a stored response, as it was sent; DELETE: drop it (OpenAI's deletion object)."""
    store = request.app.state.responses
    if request.method == "DELETE":
        store.delete(response_id)
        return KilnJSONResponse({"id": response_id, "object": "response", "deleted": True})
    return KilnJSONResponse(store.response(response_id))


async def tokenize(request: Request) -> Response:  # vLLM's: text or a chat -> token ids
    server = _server(request)
    return KilnJSONResponse(await off_loop(server.tokenize, await read_body(request, TokenizeRequest)))


async def detokenize(request: Request) -> Response:  # vLLM's: token ids -> text
    server = _server(request)
    return KilnJSONResponse(await off_loop(server.detokenize, await read_body(request, DetokenizeRequest)))


def _openapi(app: FastAPI, model_name: str, max_model_len: int, vocab_size: int, config: ServerConfig
             ) -> Callable[[], dict]:
    """FastAPI's schema without its 422s (bad input is answered 400 in OpenAI's shape instead), with the
    request bodies the routes parse themselves, `model` naming the one model served, and the bounds this
    model sets (max_tokens within the context, token ids within the vocabulary)."""
    generate_schema = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = generate_schema()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for body in (CompletionRequest, ChatCompletionRequest, EmbeddingRequest, ResponsesRequest, TokenizeRequest,
                     DetokenizeRequest):
            found = body.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(found.pop("$defs", {}))
            components[body.__name__] = found
            named = found["properties"]["model"]
            if "anyOf" in named:  # optional: the one model's name or null
                named["anyOf"] = [{"type": "string", "enum": [model_name]}, {"type": "null"}]
            else:
                named["enum"] = [model_name]
            for field in ("prompt", "input", "stop_token_ids", "tokens"):
                _bound_integers(found["properties"].get(field, {}), 0, vocab_size - 1)
            for kind in found["properties"].get("logit_bias", {}).get("anyOf", []):
                if "patternProperties" in kind:  # its keys: token ids in the vocabulary
                    kind["propertyNames"] = {"pattern": _ids_below(vocab_size)}
        for body, field in (("CompletionRequest", "max_tokens"), ("ChatCompletionRequest", "max_tokens"),
                            ("ChatCompletionRequest", "max_completion_tokens")):
            _bound_integers(components[body]["properties"][field], 0, max_model_len - 1)  # a prompt takes 1 at least
        for parameter in schema["paths"]["/v1/models/{model_id}"]["get"]["parameters"]:
            parameter["schema"]["enum"] = [model_name]
        for component in components.values():  # as FastAPI writes them: an absent field, not a null default
            for field in component.get("properties", {}).values():
                if "default" in field and field["default"] is None:
                    del field["default"]
        for operations in schema["paths"].values():
            for method, operation in operations.items():
                operation["responses"].pop("422", None)
                if len(operations) > 1:  # one route for several methods: FastAPI gives them all one id
                    operation["operationId"] = f"{operation['operationId'].rsplit('_', 1)[0]}_{method}"
        components.pop("HTTPValidationError", None)
        components.pop("ValidationError", None)
        if config.api_key is not None:
            schema["components"]["securitySchemes"] = {"apiKey": {"type": "http", "scheme": "bearer"}}
            for path, operations in schema["paths"].items():
                if not needs_key(path, config.api_key_scope, config.auth_exempt):
                    continue
                for operation in operations.values():
                    operation["security"] = [{"apiKey": []}]
                    operation["responses"].update({"401": {
                        "description": _errors(401)[401]["description"],
                        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}})
        app.openapi_schema = schema
        return schema

    return openapi


def _bound_integers(schema, low: int, high: int) -> None:
    """Every integer in `schema` (token ids, however nested) within [low, high]."""
    if isinstance(schema, dict):
        if schema.get("type") == "integer":
            schema["minimum"], schema["maximum"] = max(schema.get("minimum", low), low), high
        for value in schema.values():
            _bound_integers(value, low, high)
    elif isinstance(schema, list):
        for value in schema:
            _bound_integers(value, low, high)


def _ids_below(n: int) -> str:
    """A regex of the decimal numbers in [0, n), leading zeros allowed (as `int` reads a logit_bias key)."""
    top = str(n - 1)
    ranges = [f"[0-9]{{1,{len(top) - 1}}}"] if len(top) > 1 else []
    ranges += [top[:i] + f"[0-{int(d) - 1}]" + f"[0-9]{{{len(top) - i - 1}}}" for i, d in enumerate(top) if d != "0"]
    return f"^0*({'|'.join([*ranges, top])})$"


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
    Under tensor parallelism this is rank 0, and `feed` carries each step's requests to the others.
    Raises KilnError if the engine thread stops on a failure, after the listener has shut down."""
    config = config or ServerConfig()
    warm_up(llm)
    name = model_name or llm.model_name
    engine = AsyncEngine(llm.engine, feed=feed, model_name=name, max_queued=config.max_queued_requests,
                         request_timeout=config.request_timeout)
    url = f"{config.scheme}://{config.host}:{config.port}"
    app = create_app(engine, llm.tokenizer, name, llm.engine.max_model_len, config=config,
                     on_ready=lambda: logger.info("ready: %s serves %s", url, name))
    listener = _Listener(uvicorn.Config(
        app, host=config.host, port=config.port, log_level="warning", http=guarded_protocol(config.header_timeout),
        timeout_keep_alive=config.keep_alive_timeout, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        ssl_keyfile=config.ssl_keyfile, ssl_certfile=config.ssl_certfile, ssl_ciphers=config.ssl_ciphers),
        engine, config.shutdown_timeout)
    died: list[BaseException | None] = []

    def stopped() -> None:  # on the engine thread, which ended other than by shutdown
        died.append(engine.error)
        logger.critical("the engine thread stopped (%s): shutting the server down", engine.error)
        listener.should_exit = True

    engine.on_stopped = stopped
    engine.start()
    try:
        listener.run()
    finally:
        engine.shutdown()
    if died:
        raise KilnError(f"the engine stopped ({died[0]!r}); the server exited so that its supervisor can restart it")


GRACEFUL_SHUTDOWN_S = 10
"""Seconds a stopping server waits, after its requests finished or were ended, for their responses to be sent."""


class _Listener(uvicorn.Server):
    """uvicorn's server, where SIGTERM or SIGINT drains rather than cuts: admission stops (503 with
    Retry-After, /health 503) while the listener stays open, the admitted requests run for up to
    `shutdown_timeout` seconds, the rest end with an error (an error event, or a 503), and then the
    server exits 0. A second signal exits at once."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, shutdown_timeout: float):
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._drain_task: asyncio.Task | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame) -> None:  # the signal handler, on the event loop's thread
        if self._draining or self._loop is None:  # a second signal, or one before the loop listens
            logger.warning("%s %s: exiting now", signal.Signals(sig).name,
                           "again" if self._draining else "before the server listened")
            self.should_exit = self.force_exit = True
            return
        self._draining = True
        self._loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)

    def _start_drain(self, signal_name: str) -> None:
        self._drain_task = self._loop.create_task(self._drain(signal_name))  # held: the loop keeps tasks weakly

    async def _drain(self, signal_name: str) -> None:
        engine, timeout = self.engine, self.shutdown_timeout
        engine.close(f"the server is shutting down ({signal_name}): retry on another replica or after the restart")
        logger.warning("%s: admitting no more requests; %d in flight get up to %g s (--shutdown-timeout) to finish",
                       signal_name, engine.num_requests, timeout)
        deadline = time.monotonic() + timeout
        while engine.num_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        ended = engine.end_all(EngineUnavailable(
            f"the server shut down ({signal_name}) before this request finished: its --shutdown-timeout of "
            f"{timeout:g} s passed; retry it"))
        if ended:
            logger.warning("ended %d requests still running after %g s", ended, timeout)
        self.should_exit = True
