"""Every failure as OpenAI's error shape: the error a route raises (`ServerError`), the exception
handlers that give each failure its status, the error event of a stream that already started, and the
API-key middleware that answers 401 before a body is read."""

import hmac
import logging

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

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code, self.param = status, kind, code, param


class KilnJSONResponse(JSONResponse):
    """JSON every client parses: no NaN or Infinity (`protocol.to_json`)."""

    def render(self, content) -> bytes:
        return to_json(content)


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
          code: str | None = None) -> JSONResponse:
    """OpenAI's error shape."""
    return KilnJSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


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
        response = error(401, message, code="invalid_api_key")
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error(400, f"invalid request: {exc.errors()[0].get('msg', '') if exc.errors() else ''}")


async def _http(request: Request, exc: HTTPException) -> JSONResponse:
    kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
    response = error(exc.status_code, str(exc.detail), kind)
    response.headers.update(exc.headers or {})  # a 405's Allow
    return response


async def _server_error(request: Request, exc: ServerError) -> JSONResponse:
    return error(exc.status, str(exc), exc.kind, param=exc.param, code=exc.code)


async def _kiln_error(request: Request, exc: KilnError) -> JSONResponse:
    return error(400, str(exc))


async def _request_failed(request: Request, exc: RequestFailed) -> JSONResponse:
    return error(400, str(exc)) if exc.client_error else error(500, str(exc), "server_error")


async def _step_failed(request: Request, exc: StepFailed) -> JSONResponse:
    return error(500, str(exc), "server_error")


async def _unavailable(request: Request, exc: EngineUnavailable) -> JSONResponse:
    return error(503, str(exc), "server_error")


async def _overloaded(request: Request, exc: Overloaded) -> JSONResponse:
    response = error(503, str(exc), "server_error", code="overloaded")
    response.headers["Retry-After"] = "1"
    return response


async def _shutting_down(request: Request, exc: ShuttingDown) -> JSONResponse:
    response = error(503, str(exc), "server_error", code="shutting_down")
    response.headers["Retry-After"] = "5"
    return response


async def _timed_out(request: Request, exc: RequestTimedOut) -> JSONResponse:
    return error(408, str(exc), "timeout_error")


async def _bug(request: Request, exc: Exception) -> JSONResponse:  # never expected: logged with its trace
    logger.exception("error serving %s %s", request.method, request.url.path)
    return error(500, f"internal error: {type(exc).__name__}", "server_error")


HANDLERS = {RequestValidationError: _invalid, HTTPException: _http, ServerError: _server_error,
            KilnError: _kiln_error, RequestFailed: _request_failed, StepFailed: _step_failed,
            EngineUnavailable: _unavailable, Overloaded: _overloaded, ShuttingDown: _shutting_down,
            RequestTimedOut: _timed_out, Exception: _bug}
"""The handler of each failure; Starlette picks the one nearest the raised type in its MRO."""


def add_error_handlers(app: FastAPI) -> None:
    """Every failure as OpenAI's error shape, with the status it deserves."""
    for kind, handler in HANDLERS.items():
        app.add_exception_handler(kind, handler)


def stream_error(e: Exception) -> dict:
    """The message and type of an error event, as the same failure would be answered before streaming."""
    if isinstance(e, RequestTimedOut):
        return {"message": str(e), "type": "timeout_error"}
    if isinstance(e, KilnError) or (isinstance(e, RequestFailed) and e.client_error):
        return {"message": str(e), "type": "invalid_request_error"}
    if isinstance(e, (StepFailed, EngineUnavailable, RequestFailed)):
        return {"message": str(e), "type": "server_error"}
    logger.error("error in a response stream", exc_info=e)
    return {"message": f"internal error: {type(e).__name__}: {e}", "type": "server_error"}
