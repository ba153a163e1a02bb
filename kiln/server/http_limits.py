"""How much of a client's time and bytes the server takes before it answers: a request body over the
size limit is refused with 413 before it is read (from Content-Length, or as soon as a streamed body
passes the limit), a body that does not arrive in time gets 408, and a connection whose request
headers do not arrive in time is closed. A client that sends slowly or sends too much costs the
server a socket for a bounded time, never memory or the event loop."""

import asyncio
import contextlib
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kiln.server.errors import error_body


class BodyLimit:
    """ASGI middleware: at most `max_bytes` of request body, all of it within `timeout` seconds of the
    first read; past either, an answer in the server's error shape (413 or 408) and the connection closed.
    The app then sees the client as gone."""

    def __init__(self, app, max_bytes: int, timeout: float | None):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send, 413, self._too_large(int(declared)))
        state = {"received": 0, "done": False, "answered": False, "deadline": None}

        async def guarded_send(message) -> None:
            if not state["answered"]:
                await send(message)

        async def limited_receive():
            if state["answered"]:
                return {"type": "http.disconnect"}
            if state["done"] or self.timeout is None:  # the body is in: later reads wait for a disconnect
                message = await receive()
            else:
                loop = asyncio.get_running_loop()
                state["deadline"] = state["deadline"] or loop.time() + self.timeout
                try:
                    message = await asyncio.wait_for(receive(), max(state["deadline"] - loop.time(), 0))
                except TimeoutError:
                    await self._answer(send, state, 408, f"the request body did not arrive within {self.timeout:g} s "
                                       "(--body-timeout)")
                    return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                state["done"] = not message.get("more_body", False)
                if state["received"] > self.max_bytes:
                    await self._answer(send, state, 413, self._too_large(None))
                    return {"type": "http.disconnect"}
            return message

        await self.app(scope, limited_receive, guarded_send)

    def _too_large(self, size: int | None) -> str:
        told = f"the request body is {size} bytes" if size is not None else "the request body runs past the limit"
        return f"{told}; this server takes at most {self.max_bytes} bytes (--max-request-bytes moves the limit)"

    async def _answer(self, send, state: dict, status: int, message: str) -> None:
        """Answer once, unless the app already started its own response."""
        if not state["answered"]:
            state["answered"] = True
            await self._refuse(send, status, message)

    @staticmethod
    async def _refuse(send, status: int, message: str) -> None:
        body = json.dumps(error_body(status, message)).encode()
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


LINGER_SECONDS = 10.0
"""How long a connection refused mid-body goes on reading (and dropping) what the client still sends."""


class _LingeringTransport:
    """The transport uvicorn's request cycle sees: closing it while the client is still sending its
    body lingers instead (nginx's lingering close). Closed at once, the socket would answer the
    client's next bytes with a reset, and most clients, writing the body before they read, would lose
    the 413 sent to them."""

    def __init__(self, transport, protocol: "H11Protocol"):
        self._transport, self._protocol = transport, protocol

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def close(self) -> None:
        if self._protocol.conn.their_state is h11.SEND_BODY and self._protocol.connected:
            self._protocol.linger()
        else:
            self._transport.close()


def guarded_protocol(header_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with two guards. A connection whose next request's headers have not all
    arrived `header_timeout` seconds after it opened, or after its previous response ended, is closed
    (uvicorn's own keep-alive timer restarts at every byte, so a client sending one a second holds a
    socket for ever). A connection closed while its client is still sending a body lingers."""

    class Guarded(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _waiting_since = None  # the request cycle that was current when the wait began
        _lingering = False
        connected = False

        def connection_made(self, transport) -> None:
            self.connected = True
            super().connection_made(_LingeringTransport(transport, self))
            self._arm()

        def data_received(self, data: bytes) -> None:
            if not self._lingering:  # lingering, what comes is dropped
                super().data_received(data)

        def eof_received(self) -> bool | None:
            if self._lingering:
                self.transport._transport.close()
            return super().eof_received()

        def linger(self) -> None:
            """Send what is written, then read and drop until the client stops or LINGER_SECONDS pass."""
            self._lingering = True
            self._disarm()
            self._unset_keepalive_if_required()
            self.flow.resume_reading()  # uvicorn paused it when the unread body filled its buffer
            if self.transport.can_write_eof():
                self.transport.write_eof()  # the response is whole: the client may read it and stop sending
            self._timer = self.loop.call_later(LINGER_SECONDS, self.transport._transport.close)

        def on_response_complete(self) -> None:
            if self._lingering:
                return
            self._arm()  # before uvicorn starts a pipelined request, which then disarms it
            super().on_response_complete()

        def handle_events(self) -> None:
            super().handle_events()
            if self._timer is not None and self.cycle is not self._waiting_since:
                self._disarm()  # a new request's headers are in

        def connection_lost(self, exc) -> None:
            self.connected = False
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing() and not self._lingering:
                self._waiting_since = self.cycle
                self._timer = self.loop.call_later(header_timeout, self._expire)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expire(self) -> None:
            self._timer = None
            if self.cycle is self._waiting_since and not self.transport.is_closing():
                with contextlib.suppress(h11.LocalProtocolError):
                    self.conn.send(h11.ConnectionClosed())
                self.transport.close()

    return Guarded
