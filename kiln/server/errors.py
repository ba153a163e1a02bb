"""Every failure in one error shape, vLLM's (OpenAI's, with the status as its code): the error a route
raises (`ServerError`), the exception handlers that give each failure its status, the error event of a
stream that already started, and the API-key middleware that answers 401 before a body is read."""

import hmac
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kiln.errors import KilnError
from kiln.runtime.async_engine import (EngineUnavailable, Overloaded, RequestFailed, RequestTimedOut, ShuttingDown,
                                       StepFailed)
from kiln.server.protocol import to_json

logger = logging.getLogger(__name__)


class ServerError(Exception):
    """A 4xx the route decided on, raised from deep in request handling."""

    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


class KilnJSONResponse(JSONResponse):
    """JSON every client parses: no NaN or Infinity (`protocol.to_json`)."""

    def render(self, content) -> bytes:
        return to_json(content)


_SDK_NAMES = {401: "AuthenticationError", 403: "PermissionDeniedError", 429: "RateLimitError"}
"""The statuses whose type is the openai SDK's exception name rather than the status's phrase."""


def error_type(status: int) -> str:
    """vLLM's error type of a status: BadRequestError, NotFoundError, InternalServerError, ... (the openai
    SDK's exception names, which are the statuses' phrases but for 401, 403 and 429)."""
    name = _SDK_NAMES.get(status) or HTTPStatus(status).phrase.replace(" ", "").replace("-", "")
    return name if name.endswith("Error") else name + "Error"


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """vLLM's error shape, the one every failure takes (a stream's error event too): the status again as
    the code, and the type named for it."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": status}}


def error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return KilnJSONResponse(error_body(status, message, param), status)


def needs_key(path: str, scope: str, exempt: tuple[str, ...] = ()) -> bool:
    """Whether `path` needs the API key: under scope "v1" the API under /v1/ (vLLM's rule), under
    "all" every path but the exempt ones."""
    if scope == "v1":
        return path == "/v1" or path.startswith("/v1/")
    return path not in exempt


class ApiKeyMiddleware:
    """Answers 401 in OpenAI's shape to a request without `Authorization: Bearer <key>`, before its
    body is read, on the paths that need it (`needs_key`). Pure ASGI: streaming and disconnects pass
    through untouched."""

    def __init__(self, app, key: str, scope: str = "v1", exempt: tuple[str, ...] = ()):
        self.app, self._key, self._scope, self._exempt = app, key.encode(), scope, tuple(exempt)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not needs_key(scope["path"], self._scope, self._exempt):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self._key):
            return await self.app(scope, receive, send)
        message = ("the API key is not valid" if given else
                   "no API key: send `Authorization: Bearer <key>` (this server requires one)")
        response = error(401, message)
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error(400, f"invalid request: {exc.errors()[0].get('msg', '') if exc.errors() else ''}")


async def _http(request: Request, exc: HTTPException) -> JSONResponse:
    response = error(exc.status_code, str(exc.detail))
    response.headers.update(exc.headers or {})  # a 405's Allow
    return response


async def _server_error(request: Request, exc: ServerError) -> JSONResponse:
    return error(exc.status, str(exc), param=exc.param)


async def _kiln_error(request: Request, exc: KilnError) -> JSONResponse:
    return error(400, str(exc))


async def _request_failed(request: Request, exc: RequestFailed) -> JSONResponse:
    return error(400 if exc.client_error else 500, str(exc))


async def _step_failed(request: Request, exc: StepFailed) -> JSONResponse:
    return error(500, str(exc))


async def _unavailable(request: Request, exc: EngineUnavailable) -> JSONResponse:
    return error(503, str(exc))


async def _overloaded(request: Request, exc: Overloaded) -> JSONResponse:
    response = error(503, str(exc))
    response.headers["Retry-After"] = "1"
    return response


async def _shutting_down(request: Request, exc: ShuttingDown) -> JSONResponse:
    response = error(503, str(exc))
    response.headers["Retry-After"] = "5"
    return response


async def _timed_out(request: Request, exc: RequestTimedOut) -> JSONResponse:
    return error(408, str(exc))


async def _bug(request: Request, exc: Exception) -> JSONResponse:  # never expected: logged with its trace
    logger.exception("error serving %s %s", request.method, request.url.path)
    return error(500, f"internal error: {type(exc).__name__}")


HANDLERS = {RequestValidationError: _invalid, HTTPException: _http, ServerError: _server_error,
            KilnError: _kiln_error, RequestFailed: _request_failed, StepFailed: _step_failed,
            EngineUnavailable: _unavailable, Overloaded: _overloaded, ShuttingDown: _shutting_down,
            RequestTimedOut: _timed_out, Exception: _bug}
"""The handler of each failure; Starlette picks the one nearest the raised type in its MRO."""


def add_error_handlers(app: FastAPI) -> None:
    """Every failure in the one error shape, with the status it deserves."""
    for kind, handler in HANDLERS.items():
        app.add_exception_handler(kind, handler)


def stream_error(e: Exception) -> dict:
    """A stream's error event: the body the same failure gets when it comes before the stream starts."""
    if isinstance(e, RequestTimedOut):
        return error_body(408, str(e))
    if isinstance(e, KilnError) or (isinstance(e, RequestFailed) and e.client_error):
        return error_body(400, str(e))
    if isinstance(e, EngineUnavailable):
        return error_body(503, str(e))
    if isinstance(e, (StepFailed, RequestFailed)):
        return error_body(500, str(e))
    logger.error("error in a response stream", exc_info=e)
    return error_body(500, f"internal error: {type(e).__name__}: {e}")
